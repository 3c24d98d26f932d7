"""A large-model agent of your own task (``fedpar client --task examples/own_task.py:task --nproc 2 --fsdp 2``: two
gloo ranks, FSDP2; or one NCCL rank on a GPU) next to an ordinary agent of the same task, over real gRPC: the
coordinator takes both agents' uploads (the same weight names and shapes as a single-process agent's), the new
global is the weighted FedAvg of the uploads, and the engine agent's update is what single-process training of the
task (its loss, its AdamW) produces from the same global weights on the same data in the same batches: the order a
simulated member of the agent's id draws (client/local_loop.py member_seed), cut over the ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from fedpar.aggregation import build_strategy
from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.local_loop import member_seed
from fedpar.client.task_trainer import TaskTrainer
from fedpar.models import get_weights, set_weights, weight_specs
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator
from fedpar.task import Partition
from fedpar.tasks.reference import load_task
from support.own_task import EXAMPLE, write_table

PARTS, ENGINE_PART, PLAIN_PART = 2, 0, 1  # of 320 rows: 115 training examples each, odd, so one FSDP rank pads
# 4 steps an epoch (the last of 19 examples: one FSDP rank gets 16 of it, the other 3 and padding), so the result
# depends on the order of the examples
EPOCHS, BATCH, LR = 2, 32, 0.01
OPTIONS = {"hidden": 8}


def _data(task, index: int):
    return task.client_data(Partition(index, PARTS, "", "iid", 0, 0.1))


def _recording_fedavg():
    """FedAvg that keeps each round's global weights and a copy of every update folded in."""
    strategy = build_strategy("fedavg")
    globals_, folds = {}, {}
    begin, fold_many = strategy.begin_round, strategy.fold_many

    def begin_round(round_id, weights):
        globals_[round_id] = [np.array(a) for a in weights]
        folds[round_id] = {}
        begin(round_id, weights)

    def record(items, **options):  # the coordinator folds through fold_many (server/round_modes.py FoldQueue)
        for item in items:
            folds[strategy.round_id][item.client_id] = ([np.array(a) for a in item.update], item.num_examples)
        return fold_many(items, **options)

    strategy.begin_round, strategy.fold_many = begin_round, record
    return strategy, globals_, folds


def _single_process_update(task, data, weights, round_id: int) -> tuple[list[np.ndarray], int]:
    trainer = TaskTrainer(task, data, seed=member_seed(0, "big"))  # the engine agent's id, --seed's default
    set_weights(trainer.model, weights)
    result = trainer.train(EPOCHS, BATCH, LR, round_id=round_id)
    return get_weights(trainer.model), result.examples


# gloo: two CPU ranks under FSDP2 on any machine; nccl: the agent on a GPU, one torchrun rank (NCCL takes one GPU
# per rank, and a one-GPU box has one), its update compared with the CPU reference at GPU float tolerance.
ENGINE_LAUNCHES = {
    "gloo": ([sys.executable, "-m", "fedpar.cli.main", "client", "--nproc", "2", "--fsdp", "2", "--device", "cpu"],
             1e-5),
    "nccl": ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
              "-m", "fedpar.cli.main", "client", "--device", "cuda"], 1e-4),
}


@pytest.mark.parametrize("backend", [
    "gloo", pytest.param("nccl", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_engine_agent_and_plain_agent_run_fedavg_rounds(tmp_path, backend):
    launch, tolerance = ENGINE_LAUNCHES[backend]
    start = time.monotonic()
    csv = write_table(tmp_path / "table.csv", rows=320)
    task = load_task(EXAMPLE, {"csv": str(csv), **OPTIONS})
    engine_data = _data(task, ENGINE_PART)
    torch.manual_seed(0)
    init = get_weights(task.model())
    strategy, globals_, folds = _recording_fedavg()
    config = CoordinatorConfig(rounds=2, clients_per_round=2, min_available=2, overselect=1.0, deadline_seconds=30.0,
                               heartbeat_seconds=1.0, liveness_timeout_seconds=20.0, local_epochs=EPOCHS,
                               batch_size=BATCH, learning_rate=LR, metrics_path=tmp_path / "metrics.jsonl")
    specs = weight_specs(task.model())  # what a single-process agent of the task uploads
    names = [name for name, _, _ in specs]
    server = CoordinatorServer(Coordinator(config, names, init, strategy))
    server.start()
    log = (tmp_path / "engine_agent.log").open("w")
    engine = subprocess.Popen(
        [*launch, "--server", server.address, "--agent-id", "big",
         "--insecure", "--task", EXAMPLE, "--task-option", f"csv={csv}",
         *(a for k, v in OPTIONS.items() for a in ("--task-option", f"{k}={v}")), "--num-partitions", str(PARTS),
         "--partition-index", str(ENGINE_PART), "--poll", "1", "--give-up-after", "30", "--dist-timeout", "60"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    plain = Agent(AgentConfig(insecure=True,
                              server=server.address, agent_id="small", poll_seconds=1.0, give_up_after=30.0, seed=0),
                  TaskTrainer(task, _data(task, PLAIN_PART), seed=0))
    plain_thread = threading.Thread(target=plain.run, daemon=True)
    plain_thread.start()
    try:
        assert server.wait(60), "the two rounds did not finish"
        assert engine.wait(30) == 0, "the engine agent did not exit cleanly after shutdown"
        plain_thread.join(15)
    finally:
        if engine.poll() is None:
            engine.kill()
        server.stop()
        log.close()
    output = (tmp_path / "engine_agent.log").read_text()
    assert "2 tasks, 2 updates accepted, 0 refused" in output, output

    rows = list(server.coordinator.metrics.read_rows())
    assert [(r["status"], r["reported"]) for r in rows] == [("ok", 2), ("ok", 2)]
    for round_id in (1, 2):
        uploads = folds[round_id]
        assert set(uploads) == {"big", "small"}
        assert [(a.shape, a.dtype.name) for a in uploads["big"][0]] == [(shape, dtype) for _, dtype, shape in specs]
        # The new global is the weighted FedAvg of what was uploaded.
        after = globals_[2] if round_id == 1 else server.coordinator.weights
        total = sum(n for _, n in uploads.values())
        for i, new in enumerate(after):
            expected = sum(np.float64(n) * w[i].astype(np.float64) for w, n in uploads.values()) / total
            np.testing.assert_allclose(new, expected, rtol=1e-6, atol=1e-6)
        # The two-rank FSDP agent uploaded what one process training the task on the same data would have.
        reference, examples = _single_process_update(task, engine_data, globals_[round_id], round_id)
        update, reported = uploads["big"]
        assert reported == examples == EPOCHS * len(engine_data.train)
        assert max(float(np.abs(a - b).max()) for a, b in zip(update, reference)) < tolerance
    assert time.monotonic() - start < 60


def test_ctrl_c_to_a_large_model_agent_stops_its_ranks_at_once(tmp_path):
    """SIGINT to the agent's process (what kill -INT, timeout -s INT or a supervisor sends): it printed
    'interrupted' but its ranks trained on until the run ended, minutes later (QA). It says what it did, once, as a
    one-process agent does: it printed only 'interrupted', without its counts (QA)."""
    import signal

    config = CoordinatorConfig(rounds=100, clients_per_round=1, min_available=1, overselect=1.0, local_epochs=5,
                               heartbeat_seconds=1.0, liveness_timeout_seconds=20.0, metrics_path=tmp_path / "m.jsonl")
    from fedpar.models.for_data import build_model_for_data

    model = build_model_for_data("mlp", (1, 8, 8), 10)  # the agent's model: the zoo's MLP on digits
    names = [name for name, _, _ in weight_specs(model)]
    server = CoordinatorServer(Coordinator(config, names, get_weights(model), build_strategy("fedavg")))
    server.start()
    agent = subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", "client", "--nproc", "2", "--fsdp", "2",
                              "--device", "cpu", "--server", server.address, "--agent-id", "big", "--insecure",
                              "--model", "mlp", "--poll", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        end = time.monotonic() + 90
        while not list(server.coordinator.metrics.read_rows()):  # the ranks trained a round: they are busy
            assert agent.poll() is None and time.monotonic() < end, agent.communicate()[0][-3000:]
            time.sleep(0.2)
        agent.send_signal(signal.SIGINT)
        started = time.monotonic()
        code = agent.wait(20)
        assert code == 130 and time.monotonic() - started < 10, code
        output = agent.communicate()[0]
        assert "Traceback" not in output, output[-3000:]
        said = [line for line in output.splitlines() if "interrupted" in line]
        assert len(said) == 1 and re.fullmatch(r"fedpar client: interrupted after ([1-9]\d*) tasks?, \d+ updates? "
                                               r"accepted, \d+ refused", said[0]), output[-3000:]
    finally:
        if agent.poll() is None:
            agent.kill()
        server.stop()
