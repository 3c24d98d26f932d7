"""`fedpar serve --aggregator-ranks 2` (gloo, real processes) against scripted agents over loopback gRPC.

Agents are dealt over both ranks; each rank checks what it receives and folds it into its own partial sum; rank 0
decides which uploads count; the all-reduced round equals a one-rank coordinator's on the same uploads.
"""

from __future__ import annotations

import json
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedpar.aggregation import build_strategy
from fedpar.datasets import load_dataset
from support.ports import free_port
from fedpar.protocol.codec import CoordinatorStub, ModelLayout, channel_options, layout_to_pb
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.checkpoint import load_checkpoint
from fedpar.server.config import CoordinatorConfig
from fedpar.tasks.reference import load_task
from fedpar.client.host_partial import HostSum
from fedpar.client.transfer import download_weights
from fedpar.protocol import fedpar_pb2 as pb
from support.devices import RANKS_ON_CPU
from support.digit_agents import start_digit_agents
from support.own_task import EXAMPLE, write_table
from support.population_calls import join_members, member_auth, pull_tasks, refused, upload_batch
from support.ports import free_port_run
from support.processes import children, listening, not_on_loopback
from support.scripted_agent import ScriptedAgent
from support.synthetic_members import main as host_synthetic_members

ROOT = Path(__file__).resolve().parents[2]
IDS = ["a0", "a1", "a2", "a3"]  # dealt a0, a2 -> rank 0 and a1, a3 -> rank 1 (sorted, fewest agents first)
EXAMPLES = {"a0": 50, "a1": 120, "a2": 80, "a3": 200}
NAMES = [t.name for t in ModelLayout.of_arrays(*(lambda a: (a.names, a.weights))(
    CoordinatorAssembly.for_data("mlp", load_dataset("digits"), 0, None))).tensors]


def _layout() -> ModelLayout:
    """The layout of `fedpar serve`'s default model (mlp on digits)."""
    assembly = CoordinatorAssembly.for_data("mlp", load_dataset("digits"), 0, None)
    return ModelLayout.of_arrays(assembly.names, assembly.weights)


QUICK_TRAINING = ["--local-epochs", "1", "--batch-size", "32", "--lr", "0.05"]  # the defaults are 5, 16, 0.1


def _serve(tmp: Path, ranks: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fedpar.cli.main", "serve", "--insecure", "--port", "0", "--port-file",
           str(tmp / "port"), "--checkpoint-dir", str(tmp / "ckpt"), "--out", str(tmp / "out"), "--no-central-eval",
           "--no-plot",
           "--aggregator-ranks", str(ranks), *RANKS_ON_CPU, "--inline-weights-bytes", "0", "--overselect", "1.0",
           "--min-available", "4", "--heartbeat", "1", "--liveness-timeout", "30",
           *(("--aggregator-timeout", "30") if ranks > 1 else ()), *QUICK_TRAINING, *flags]
    tmp.mkdir(parents=True, exist_ok=True)
    with open(tmp / "serve.log", "a") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                stderr=subprocess.STDOUT)


def _port(tmp: Path, proc: subprocess.Popen, log: str = "serve.log") -> int:
    end = time.monotonic() + 90
    while time.monotonic() < end and not (tmp / "port").exists():
        assert proc.poll() is None, (tmp / log).read_text()
        time.sleep(0.1)
    return int((tmp / "port").read_text())


class RankedAgent(ScriptedAgent):
    """A scripted agent that downloads from and uploads to the aggregator rank its task names."""

    def ingest(self, task) -> CoordinatorStub:
        """The stub for the task's rank (the coordinator's own when the task names none)."""
        if not task.ingest_port:
            return self.stub
        self.ingest_channel = grpc.insecure_channel(f"127.0.0.1:{task.ingest_port}",
                                                    options=channel_options(64 << 20))
        return CoordinatorStub(self.ingest_channel)

    def fetch(self, task, layout: ModelLayout) -> list[np.ndarray]:
        """The round's global model, from the task's rank."""
        self.stub, main = self.ingest(task), self.stub
        try:
            return self.download(task, layout)
        finally:
            self.stub = main

    def send(self, task, arrays, num_examples: int, names, to_rank0: bool = False):
        """Upload to the task's rank (or to rank 0 when told to)."""
        main = self.stub
        if not to_rank0:
            self.stub = self.ingest(task)
        try:
            return self.upload(task, arrays, num_examples, names=names)
        finally:
            self.stub = main


def _update(agent_id: str, round_id: int, weights: list[np.ndarray]) -> list[np.ndarray]:
    """A deterministic update of the agent's own: the global model moved by an agent- and round-specific step."""
    rng = np.random.default_rng(1000 * round_id + int(agent_id[1:]))
    return [(w + rng.normal(0, 0.1, w.shape)).astype(w.dtype) for w in weights]


def _rows(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]


def _agents_rounds(port: int, rounds: int, layout: ModelLayout, proc: subprocess.Popen | None = None) -> list[int]:
    """``rounds`` rounds of the 4 agents against the coordinator on ``port`` (its ranks, when ``proc`` serves more
    than one, listening on loopback alone); 1 for each task dealt to rank 1, else 0."""
    names = [t.name for t in layout.tensors]
    dealt = []
    agents = [RankedAgent(f"127.0.0.1:{port}", a, EXAMPLES[a]) for a in IDS]
    for round_id in range(1, rounds + 1):
        for agent in agents:
            task = agent.task(60)
            assert task.round == round_id
            dealt.append(1 if task.ingest_port else 0)
            weights = agent.fetch(task, layout)
            reply = agent.send(task, _update(agent.agent_id, round_id, weights), EXAMPLES[agent.agent_id], names)
            assert reply.accepted, reply.message
        if proc is not None and round_id == 1:  # every rank is up: its store, gloo and ports listen on loopback alone
            heard = listening(proc.pid)
            assert len(heard) >= 4 and not not_on_loopback(heard), heard
    for agent in agents:  # told on their next poll: serve then exits without lingering
        assert agent.shutdown_reason() == f"training finished after round {rounds}"
    return dealt


def _run_rounds(tmp: Path, rounds: int, *flags: str,
                layout: ModelLayout | None = None) -> tuple[list[np.ndarray], list[dict], list[int]]:
    """Serve ``rounds`` rounds of 4 agents on 2 ranks (of a model of ``layout``; default: the mlp on digits); the
    final model, the rows, each agent's ranks."""
    layout = layout or _layout()
    proc = _serve(tmp, 2, "--rounds", str(rounds), "--clients-per-round", "4", *flags)
    try:
        dealt = _agents_rounds(_port(tmp, proc), rounds, layout, proc)
        assert proc.wait(60) == 0, (tmp / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    return load_checkpoint(tmp / "ckpt").arrays, _rows(tmp), dealt


def test_two_ranks_give_the_one_rank_models_bit_for_bit_with_agents_spread_over_both(tmp_path):
    # float64 running sums: rank 0 folds a0 + a2, rank 1 a1 + a3, one rank a0 + a1 + a2 + a3, and each of these
    # float64 sums of weighted float32 values is exact here, so the order cannot show (float32 sums differ by 1e-7).
    # The model is a user's task: every rank loads it by reference for the weight names and shapes.
    csv = write_table(tmp_path / "table.csv")
    assembly = CoordinatorAssembly.for_task(load_task(EXAMPLE, {"csv": str(csv)}), 0, None)
    task = ["--fold-dtype", "float64", "--task", EXAMPLE, "--task-option", f"csv={csv}"]
    layout = ModelLayout.of_arrays(assembly.names, assembly.weights)
    # the one-rank coordinator runs in this process (serve's settings; its own model, the same seed's): what is
    # compared is its model, not a process
    rows1: list[dict] = []
    one_rank = CoordinatorAssembly.for_task(load_task(EXAMPLE, {"csv": str(csv)}), 0, None).server(
        CoordinatorConfig(rounds=2, clients_per_round=4, min_available=4, overselect=1.0, heartbeat_seconds=1.0,
                          liveness_timeout_seconds=30.0, inline_weights_max_bytes=0, fold_dtype="float64"),
        build_strategy("fedavg"), on_round_end=[rows1.append])
    one_rank.start()
    try:
        dealt1 = _agents_rounds(one_rank.port, 2, layout)
        one = [np.array(w) for w in one_rank.coordinator.weights]
    finally:
        one_rank.stop()
    two, rows2, dealt2 = _run_rounds(tmp_path / "two", 2, *task, layout=layout)
    assert [a.shape for a in two] == [w.shape for w in assembly.weights]
    assert dealt1 == [0] * 8 and sorted(dealt2) == [0] * 4 + [1] * 4  # two agents on each rank, every round
    for a, b in zip(one, two):
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(b, a)
    assert [r["reported"] for r in rows2] == [4, 4] and all(r["status"] == "ok" for r in rows2)
    assert all(r["r0_uploads"] == 2 and r["r1_uploads"] == 2 for r in rows2), rows2
    # each agent waits for its reply before the next uploads, so no update waits for a fold: each folds alone
    assert all(r[f"r{k}_fold_groups"] == 2 and r[f"r{k}_fold_group_max"] == 1 for r in rows2 for k in (0, 1)), rows2
    assert rows1[-1]["examples"] == rows2[-1]["examples"] == sum(EXAMPLES.values())


def test_rank_1_refuses_a_hostile_upload_a_misdirected_one_and_a_late_one(tmp_path):
    layout = _layout()
    proc = _serve(tmp_path, 2, "--rounds", "3", "--clients-per-round", "3", "--overselect", "1.34", "--deadline", "30")
    try:
        port = _port(tmp_path, proc)
        agents = {a: RankedAgent(f"127.0.0.1:{port}", a, EXAMPLES[a]) for a in IDS}
        tasks = {a: agent.task(60) for a, agent in agents.items()}
        assert [bool(tasks[a].ingest_port) for a in IDS] == [False, True, False, True]
        with pytest.raises(grpc.RpcError) as err:  # an agent given rank 1's port: AttributeError in its log before
            RankedAgent(f"127.0.0.1:{tasks['a1'].ingest_port}", "stray", 10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and \
            "this port is aggregator rank 1's" in err.value.details(), err.value.details()
        start = agents["a0"].fetch(tasks["a0"], layout)
        updates = {a: _update(a, 1, start) for a in IDS}

        # Round 1: rank 1 refuses a NaN update (final: the agent is out of the round); an upload sent to rank 0
        # by an agent dealt to rank 1 is refused there; the three honest ones close the round.
        bad = [u.copy() for u in updates["a1"]]
        bad[0].flat[3] = np.nan
        with pytest.raises(grpc.RpcError) as err:
            agents["a1"].send(tasks["a1"], bad, EXAMPLES["a1"], NAMES)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            agents["a3"].send(tasks["a3"], updates["a3"], EXAMPLES["a3"], NAMES, to_rank0=True)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "rank 1" in err.value.details()
        for a in ("a0", "a2", "a3"):
            assert agents[a].send(tasks[a], updates[a], EXAMPLES[a], NAMES).accepted

        # Round 2: three agents close it; the fourth (on rank 1) comes after the close and is refused.
        tasks = {a: agent.task(60) for a, agent in agents.items()}
        model1 = agents["a0"].fetch(tasks["a0"], layout)
        for a in ("a0", "a2", "a3"):
            assert agents[a].send(tasks[a], _update(a, 2, model1), EXAMPLES[a], NAMES).accepted
        with pytest.raises(grpc.RpcError) as err:
            agents["a1"].send(tasks["a1"], _update("a1", 2, model1), EXAMPLES["a1"], NAMES)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert "closed" in err.value.details() or "current round is 3" in err.value.details()
        # Round 3: all four (a1 included) are in again.
        tasks = {a: agent.task(60) for a, agent in agents.items()}
        model2 = agents["a1"].fetch(tasks["a1"], layout)
        for a in ("a0", "a1", "a2"):
            assert agents[a].send(tasks[a], _update(a, 3, model2), EXAMPLES[a], NAMES).accepted
        for agent in agents.values():
            assert agent.shutdown_reason() == "training finished after round 3"
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()
        assert "Traceback" not in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = _rows(tmp_path)
    assert [(r["reported"], r["rejected"]) for r in rows] == [(3, 1), (3, 0), (3, 0)]
    # a1's update came after round 2 reached its target: late if it was refused before the row was written, else
    # not needed; never silent
    assert (rows[1]["late"] + rows[1]["not_needed"], rows[1]["silent"]) == (1, 0)
    # Round 1's model is the weighted mean of the three honest updates: the NaN one never touched rank 1's sum.
    weights = np.array([EXAMPLES[a] for a in ("a0", "a2", "a3")], np.float64)
    expected = [sum(w * updates[a][i].astype(np.float64) for w, a in zip(weights, ("a0", "a2", "a3"))) / weights.sum()
                for i in range(len(start))]
    for got, want in zip(model1, expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


LOST_WITHIN = 8.0  # seconds from a rank's kill -9 or SIGSTOP to rank 0's line (3 s of silence, on a loaded box)


def _seconds_until(text: str, log: Path, limit: float = 60.0) -> float:
    """Seconds until ``text`` is in the ``log`` file (``limit`` if never)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if text in log.read_text():
            return time.monotonic() - start
        time.sleep(0.05)
    return limit


def test_kill_9_of_rank_1_costs_its_share_of_the_open_round_and_a_new_rank_1_is_taken_back(tmp_path):
    """kill -9 of rank 1 while its agents hold round 2: rank 0 goes on alone (one line), the round closes on rank 0's
    uploads and the next tasks all go to rank 0; the launcher starts rank 1 again, rank 0 takes it back when a round
    opens (one line, ranks_live and the Prometheus gauge back to 2), and its agents' uploads are folded there: the
    last round's model is exactly the weighted mean of its four updates, every round once."""
    layout = _layout()
    port = free_port_run(2)
    rounds = 4
    # a long collective timeout: the loss is found by rank 1's heartbeats stopping, not by a collective timing out
    proc = _serve(tmp_path, 2, "--port", str(port), "--rounds", str(rounds), "--clients-per-round", "4",
                  "--aggregator-timeout", "30", "--deadline", "60", "--metrics-port", "0")
    log_file = tmp_path / "serve.log"
    try:
        assert _port(tmp_path, proc) == port
        agents = [RankedAgent(f"127.0.0.1:{port}", a, EXAMPLES[a]) for a in IDS]
        for agent in agents:
            task = agent.task(60)
            assert agent.send(task, _update(agent.agent_id, 1, agent.fetch(task, layout)), EXAMPLES[agent.agent_id],
                              NAMES).accepted
        tasks = [agent.task(60) for agent in agents]
        assert sorted(t.ingest_port for t in tasks) == [0, 0, port + 1, port + 1]
        os.kill(int(re.search(r"aggregator rank 1 \(pid (\d+)\)", log_file.read_text()).group(1)), signal.SIGKILL)
        lost = _seconds_until("rank 1 lost", log_file)
        print(f"rank 1 killed: lost after {lost:.2f} s")
        assert lost < LOST_WITHIN, lost  # its heartbeats stopped: found within seconds, not at a collective's timeout
        for agent, task in zip(agents, tasks):
            if not task.ingest_port:  # rank 1's two agents find its port closed
                assert agent.send(task, _update(agent.agent_id, 2, agent.fetch(task, layout)),
                                  EXAMPLES[agent.agent_id], NAMES).accepted
        end = time.monotonic() + 90
        asking = "started again: waiting for rank 0 to take it back"
        while time.monotonic() < end and asking not in log_file.read_text():
            time.sleep(0.1)  # the new rank 1 asks to be taken back; a round opening after that takes it
        dealt = {}
        for round_id in range(3, rounds + 1):
            tasks = [agent.task(60) for agent in agents]
            dealt[round_id] = sorted(t.ingest_port for t in tasks)
            updates = []
            for agent, task in zip(agents, tasks):
                update = _update(agent.agent_id, round_id, agent.fetch(task, layout))
                assert agent.send(task, update, EXAMPLES[agent.agent_id], NAMES).accepted
                updates.append((update, EXAMPLES[agent.agent_id]))
        while time.monotonic() < end and len(_rows(tmp_path)) < rounds:
            time.sleep(0.1)
        metrics = re.search(r"Prometheus metrics at (\S+)", log_file.read_text()).group(1)
        with urllib.request.urlopen(metrics, timeout=10) as page:
            assert re.search(r"^fedpar_aggregator_ranks_live 2\.0$", page.read().decode(), re.M)
        for agent in agents:
            assert agent.shutdown_reason() == f"training finished after round {rounds}"
        assert proc.wait(60) == 0, log_file.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_file.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert log.count("rank 1 lost (died or hung); going on with 1 of 2 ranks (0)") == 1, log[-3000:]
    assert log.count("starting a new process for rank 1 (restart 1 of at most 3 an hour)") == 1, log[-3000:]
    assert log.count("rank 1 taken back; going on with 2 of 2 ranks (0, 1)") == 1, log[-3000:]
    assert dealt[rounds] == [0, 0, port + 1, port + 1], dealt  # the new rank 1 takes its share again
    rows = _rows(tmp_path)
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))  # every round exactly once
    assert [r["ranks_live"] for r in rows][:2] == [2, 1] and rows[-1]["ranks_live"] == 2, rows
    assert rows[1]["status"] == "ok" and rows[1]["reported"] == 2 and rows[1]["r1_uploads"] == 0, rows[1]
    assert rows[-1]["reported"] == 4 and rows[-1]["r1_uploads"] == 2, rows[-1]
    ckpt = load_checkpoint(tmp_path / "ckpt")
    total = sum(n for _, n in updates)
    for i, got in enumerate(ckpt.arrays):
        want = sum(u[i].astype(np.float64) * n for u, n in updates) / total
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_kill_9_of_rank_0_starts_every_rank_again_and_the_run_resumes_with_every_round_once(tmp_path):
    """kill -9 of rank 0 (the coordinator) under `serve --aggregator-ranks 2 --checkpoint-dir --port P`: its launcher
    says so in one line and starts every rank again; rank 0 resumes after the last checkpointed round, the agents
    re-join by themselves, and the run ends with exit 0, every round once in the metrics and the last one
    checkpointed."""
    rounds = 3
    port = free_port_run(2)
    proc = _serve(tmp_path, 2, "--port", str(port), "--rounds", str(rounds), "--clients-per-round", "4",
                  "--local-epochs", "1", "--aggregator-timeout", "4", "--deadline", "20")
    agents, threads, errors = [], [], []
    try:
        assert _port(tmp_path, proc) == port
        agents, threads, errors = start_digit_agents(port, IDS, give_up_after=90)
        end = time.monotonic() + 90
        while time.monotonic() < end and not (tmp_path / "out" / "metrics.jsonl").exists():
            time.sleep(0.05)
        rank_0 = children(proc.pid)[-2]  # the resource tracker, rank 0, rank 1: the launcher started them in turn
        assert f"pid {children(proc.pid)[-1]}" in (tmp_path / "serve.log").read_text()  # that one is rank 1
        os.kill(rank_0, signal.SIGKILL)  # round 2 is under way, or about to be
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "agents did not finish"
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        for a in agents:
            a.stop()
    assert not errors, errors
    log = (tmp_path / "serve.log").read_text()
    assert log.count("aggregator ranks: rank 0 died (signal SIGKILL); starting every rank again (restart 1 of at "
                     "most 3 an hour): rank 0 resumes after the last checkpointed round") == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert [r["round"] for r in _rows(tmp_path)] == list(range(1, rounds + 1))  # every round exactly once
    assert load_checkpoint(tmp_path / "ckpt").round_id == rounds


def test_torchrun_nnodes_2_on_loopback_runs_one_coordinator_of_two_ranks(tmp_path):
    """Two torchrun "machines" (one process each) on 127.0.0.1 are one coordinator: rank 0 serves on --port, the
    other machine's rank on --port + 1, and agents are dealt to both."""
    port = free_port_run(2)
    master = next(p for p in iter(free_port, None) if p not in (port, port + 1))  # the rendezvous: none of the ranks'
    serve = ["-m", "fedpar", "serve", "--insecure", "--port", str(port), "--port-file", str(tmp_path / "port"),
             "--out", str(tmp_path / "out"), "--no-central-eval", "--inline-weights-bytes", "0", "--overselect", "1.0",
             "--min-available", "4", "--rounds", "1", "--clients-per-round", "4", "--aggregator-timeout", "30",
             *RANKS_ON_CPU, *QUICK_TRAINING]  # two "machines" here share one GPU, if any
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(master), *serve]
        with open(tmp_path / f"node{node}.log", "w") as log:
            nodes.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        assert _port(tmp_path, nodes[0], "node0.log") == port
        layout = _layout()
        agents = [RankedAgent(f"127.0.0.1:{port}", a, EXAMPLES[a]) for a in IDS]
        ports = []
        for agent in agents:
            task = agent.task(60)
            ports.append(task.ingest_port)
            update = _update(agent.agent_id, 1, agent.fetch(task, layout))
            assert agent.send(task, update, EXAMPLES[agent.agent_id], NAMES).accepted
        assert sorted(ports) == [0, 0, port + 1, port + 1]
        for agent in agents:
            assert agent.shutdown_reason() == "training finished after round 1"
        for node in nodes:
            assert node.wait(90) == 0, "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    row = _rows(tmp_path)[0]
    assert (row["status"], row["reported"], row["r0_uploads"], row["r1_uploads"]) == ("ok", 4, 2, 2)


def test_a_hung_rank_is_dropped_and_the_round_closes_on_what_rank_0_holds(tmp_path):
    """SIGSTOP rank 1 mid-round: rank 0 declares it lost (no heartbeat); rank 1, woken, finds itself left out and
    leaves, and the launcher starts a new rank 1 (which, the rounds being over, finds no group to join and leaves in
    one line); the round closes on rank 0's two uploads and its model is exactly their weighted mean."""
    layout = _layout()
    proc = _serve(tmp_path, 2, "--rounds", "2", "--clients-per-round", "4", "--aggregator-timeout", "30",
                  "--deadline", "60", "--metrics-port", "0")
    pid = None
    try:
        port = _port(tmp_path, proc)
        agents = [RankedAgent(f"127.0.0.1:{port}", a, EXAMPLES[a]) for a in IDS]
        tasks = [agent.task(60) for agent in agents]
        for agent, task in zip(agents, tasks):
            assert agent.send(task, _update(agent.agent_id, 1, agent.fetch(task, layout)), EXAMPLES[agent.agent_id],
                              NAMES).accepted
        tasks = [agent.task(60) for agent in agents]
        model1 = agents[0].fetch(tasks[0], layout)
        pid = int(re.search(r"aggregator rank 1 \(pid (\d+)\)", (tmp_path / "serve.log").read_text()).group(1))
        os.kill(pid, signal.SIGSTOP)  # before its two agents' uploads arrive
        end = time.monotonic() + 60
        lost = _seconds_until("rank 1 lost", tmp_path / "serve.log")
        print(f"rank 1 stopped: lost after {lost:.2f} s")
        assert lost < LOST_WITHIN, lost  # its heartbeats stopped: found within seconds, not at a collective's timeout
        os.kill(pid, signal.SIGCONT)  # it finds the group re-formed without it, and leaves
        starting = "aggregator ranks: starting a new process for rank 1"
        while time.monotonic() < end and starting not in (tmp_path / "serve.log").read_text():
            time.sleep(0.1)  # the launcher starts a new process in its slot
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # the woken rank 1 left
        # Round 2, still open, closes on rank 0's two agents (sent only now: serve waits about 2 s for agents to
        # hear that the rounds are over, and this test's agents hear it only after the lines above).
        survivors = []
        for agent, task in zip(agents, tasks):
            if not task.ingest_port:
                update = _update(agent.agent_id, 2, model1)
                assert agent.send(task, update, EXAMPLES[agent.agent_id], NAMES).accepted
                survivors.append((update, EXAMPLES[agent.agent_id]))
        while time.monotonic() < end and len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) < 2:
            time.sleep(0.1)
        metrics = re.search(r"Prometheus metrics at (\S+)", (tmp_path / "serve.log").read_text()).group(1)
        with urllib.request.urlopen(metrics, timeout=10) as page:
            assert re.search(r"^fedpar_aggregator_ranks_live 1\.0$", page.read().decode(), re.M)
        for agent in agents:
            assert agent.shutdown_reason() == "training finished after round 2"
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "serve.log").read_text()
    lost = [line for line in log.splitlines() if "rank 1 lost (died or hung); going on with 1 of 2 ranks (0); "
            "their 0 upload(s) of round 2 are not counted" in line]
    assert len(lost) == 1, log[-3000:]
    assert "aggregator rank 1 was declared lost" in log, log[-3000:]
    assert log.count("aggregator ranks: starting a new process for rank 1 (restart 1 of at most 3 an hour)") == 1, \
        log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    rows = _rows(tmp_path)
    assert [(r["round"], r["status"], r["reported"], r["ranks_live"]) for r in rows] == [(1, "ok", 4, 2),
                                                                                         (2, "ok", 2, 1)], rows
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.round_id == 2
    total = sum(n for _, n in survivors)
    for i, got in enumerate(ckpt.arrays):
        want = sum(u[i].astype(np.float64) * n for u, n in survivors) / total
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


# What a rank cannot fold into a running sum of its own it hands to rank 0 at the close: a robust rule's updates, the
# updates a share cap holds back; DP's clipped sums are added up and the noise is added once, at rank 0.
@pytest.mark.parametrize("flags, build", [
    (["--strategy", "median"], lambda: build_strategy("median")),
    (["--max-agent-share", "0.3"], lambda: _capped(build_strategy("fedavg"), 0.3)),
    (["--privacy", "central", "--privacy-noise", "1e-9", "--privacy-clip", "2.0", "--privacy-population", "4"],
     lambda: build_strategy("dp-fedavg", noise_multiplier=1e-9, clip_norm=2.0, population=4, clients_per_round=4)),
], ids=["median", "share-cap", "dp-central"])
def test_two_ranks_run_what_needs_every_update_or_weight_and_give_the_one_rank_model(tmp_path, flags, build):
    layout = _layout()
    names = [t.name for t in layout.tensors]
    proc = _serve(tmp_path, 2, "--rounds", "2", "--clients-per-round", "4", "--fold-dtype", "float64", *flags)
    strategy = build()  # the same rounds on one process, for the expected models
    try:
        agents = [RankedAgent(f"127.0.0.1:{_port(tmp_path, proc)}", a, EXAMPLES[a]) for a in IDS]
        for round_id in (1, 2):
            for agent in agents:
                task = agent.task(60)
                weights = agent.fetch(task, layout)
                if agent is agents[0]:
                    strategy.begin_round(round_id, weights)
                update = _update(agent.agent_id, round_id, weights)
                strategy.fold(update, EXAMPLES[agent.agent_id], agent.agent_id)
                assert agent.send(task, update, EXAMPLES[agent.agent_id], names).accepted
            expected, _ = strategy.finish()
        for agent in agents:  # told on their next poll: serve then exits without lingering
            assert agent.shutdown_reason() == "training finished after round 2"
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = _rows(tmp_path)
    assert all(r["status"] == "ok" and (r["r0_uploads"], r["r1_uploads"]) == (2, 2) for r in rows), rows
    for got, want in zip(load_checkpoint(tmp_path / "ckpt").arrays, expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _capped(strategy, share: float):
    strategy.cap_shares(share)
    return strategy


def test_a_runtimes_members_follow_their_tasks_to_both_ranks(tmp_path, capsys):
    """A client runtime's members (run in this process: what is proven is where their tasks send them) upload to the
    rank each task names, and every round counts two on each rank."""
    proc = _serve(tmp_path, 2, "--model", "synthetic", "--params", "20000", "--rounds", "2", "--clients-per-round", "4",
                  "--accept-populations")
    try:
        port = _port(tmp_path, proc)
        capsys.readouterr()
        assert host_synthetic_members(["--server", f"127.0.0.1:{port}", "--count", "4", "--params", "20000",
                                        "--poll", "1"]) == 0
        printed = capsys.readouterr().out
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    stats = json.loads(printed.strip().splitlines()[-1])
    assert stats["finished"] == 4 and stats["refused"] == 0, stats
    assert all((r["status"], r["r0_uploads"], r["r1_uploads"]) == ("ok", 2, 2) for r in _rows(tmp_path))


def _host_round(port: int, members: list[str]) -> tuple[pb.JoinPopulationReply, dict[str, pb.TrainTask],
                                                         CoordinatorStub, CoordinatorStub]:
    """Join ``members`` as host-a's population and pull the round's task of each: the host's session, the tasks by
    member, and stubs on rank 0 and rank 1 (the port the tasks dealt there name)."""
    stub = CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options(64 << 20)))
    host = join_members(stub, "host-a", members, examples=100)
    auth = pb.AgentAuth(agent_id="host-a", token=host.host_token)
    tasks: dict[str, pb.TrainTask] = {}
    end = time.monotonic() + 60
    while len(tasks) < len(members) and time.monotonic() < end:
        tasks.update({t.agent_id: t.task for t in pull_tasks(stub, pb.PullHostTasksRequest(
            host=auth, wait_seconds=0.5), timeout=10).tasks})
    assert len(tasks) == len(members), tasks.keys()
    rank1_port = next(t.ingest_port for t in tasks.values() if t.ingest_port)
    rank1 = CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{rank1_port}", options=channel_options(64 << 20)))
    return host, tasks, stub, rank1


def _partial(layout: ModelLayout, host: pb.JoinPopulationReply, tasks: dict[str, pb.TrainTask],
             updates: dict[str, list[np.ndarray]], weights: dict[str, int], members: list[str],
             token: str | None = None) -> pb.HostUploads:
    """host-a's HostUploads carrying one partial of ``members``' updates, each of its weight (``token``: another
    session than the host's)."""
    summed = HostSum(layout, 1, ["train_loss"])
    for m in members:
        summed.add(m, tasks[m].task_id, updates[m], weights[m], 4, {"train_loss": 0.5}, (100, 1))
    return pb.HostUploads(host=pb.AgentAuth(agent_id="host-a", token=host.host_token if token is None else token),
                          partial=summed.message())


def test_a_hosts_partial_at_rank_1_is_counted_at_rank_0_and_the_round_is_the_one_rank_mean(tmp_path):
    layout = _layout()
    proc = _serve(tmp_path, 2, "--rounds", "1", "--clients-per-round", "4", "--accept-populations",
                  "--fold-dtype", "float64")
    try:
        host, tasks, stub, rank1 = _host_round(_port(tmp_path, proc), IDS)
        assert sorted(m for m, t in tasks.items() if t.ingest_port) == ["a1", "a3"]
        start = download_weights(rank1, member_auth(host, "a1"), tasks["a1"], layout, host.max_chunk_bytes)
        news = {m: _update(m, 1, start) for m in IDS}
        weights = {"a0": 50, "a1": 100, "a2": 80, "a3": 20}

        def partial(members, token=None) -> pb.HostUploads:
            return _partial(layout, host, tasks, news, weights, members, token)

        refused(lambda: upload_batch(rank1, partial(["a1", "a3"], token="guess")), grpc.StatusCode.UNAUTHENTICATED,
                "bad session token")
        misdirected = upload_batch(rank1, partial(["a0", "a1"])).partial  # a0 was dealt to rank 0: no session here
        assert not misdirected.accepted and "'a0' is not dealt to aggregator rank 1" in misdirected.message, misdirected
        taken = upload_batch(rank1, partial(["a1", "a3"])).partial
        assert taken.accepted and "2 updates accepted" in taken.message, taken
        again = upload_batch(rank1, partial(["a1", "a3"])).partial  # rank 1's share is in: its round is closed
        assert not again.accepted and "round 1 is closed" in again.message, again
        assert upload_batch(stub, partial(["a0", "a2"])).partial.accepted
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    [row] = _rows(tmp_path)
    assert (row["status"], row["num_updates"], row["r0_uploads"], row["r1_uploads"], row["r1_fold_groups"]) == \
        ("ok", 4.0, 2, 2, 1), row
    total = sum(weights.values())
    for i, got in enumerate(load_checkpoint(tmp_path / "ckpt").arrays):
        want = sum(weights[m] * news[m][i].astype(np.float64) for m in IDS) / total
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_a_partial_at_rank_1_that_would_pass_k_is_refused_whole_and_its_members_go_one_by_one(tmp_path):
    layout = _layout()
    members = [f"a{i}" for i in range(6)]  # K = 4 of 6 sampled: 3 dealt to each rank
    proc = _serve(tmp_path, 2, "--rounds", "1", "--clients-per-round", "4", "--overselect", "1.5",
                  "--min-available", "6", "--accept-populations", "--fold-dtype", "float64")
    try:
        host, tasks, stub, rank1 = _host_round(_port(tmp_path, proc), members)
        at_rank1 = sorted(m for m, t in tasks.items() if t.ingest_port)
        at_rank0 = sorted(m for m in tasks if m not in at_rank1)
        assert len(at_rank1) == 3, at_rank1
        start = download_weights(stub, member_auth(host, at_rank0[0]), tasks[at_rank0[0]], layout,
                                 host.max_chunk_bytes)
        news = {m: _update(m, 1, start) for m in members}
        weights = dict.fromkeys(members, 100)

        assert upload_batch(stub, _partial(layout, host, tasks, news, weights, at_rank0)).partial.accepted  # 3 of 4
        past_k = upload_batch(rank1, _partial(layout, host, tasks, news, weights, at_rank1)).partial
        assert not past_k.accepted and "closes after 1 more updates, fewer than the 3 to count; send them one by " \
                                       "one" in past_k.message, past_k
        one = at_rank1[1]
        header = pb.UploadHeader(auth=member_auth(host, one), round=1, task_id=tasks[one].task_id, num_examples=100,
                                 steps=4, tensors=layout_to_pb(layout), total_bytes=layout.total_bytes,
                                 metrics={"train_loss": 0.5})
        data = b"".join(np.ascontiguousarray(a).tobytes() for a in news[one])
        auth = pb.AgentAuth(agent_id="host-a", token=host.host_token)
        [result] = upload_batch(rank1, pb.HostUploads(host=auth, uploads=[pb.SmallUpload(header=header, data=data)])
                                ).results
        assert result.accepted, result  # its slot was left to upload again, and it closes the round at K
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    [row] = _rows(tmp_path)
    assert (row["status"], row["num_updates"], row["r0_uploads"], row["r1_uploads"]) == ("ok", 4.0, 3, 1), row
    counted = [*at_rank0, one]
    for i, got in enumerate(load_checkpoint(tmp_path / "ckpt").arrays):
        np.testing.assert_allclose(got, sum(news[m][i].astype(np.float64) for m in counted) / 4, rtol=0, atol=1e-6)


def test_rank_0_cannot_form_the_group_again_once_the_rendezvous_store_is_gone_and_says_so(tmp_path):
    """The rendezvous store lives in a process of its own here, as it does in torchrun's agent; once that process is
    killed, rank 0's next re-forming (after a lost rank, or to take a replacement back) fails with one RankMissing
    line naming the store: the error with which rank 0 stops the coordinator and says why in one line (leader.py,
    cli/serve.py, cli/simulate.py), not a traceback or a failed round. Rank 0 runs in a process of its own: the failed
    re-forming leaves torch's count of process groups behind, which would misname a later group in this process."""
    # The store binds port 0 and says which it got: a port picked here and bound there could be taken between.
    host = subprocess.Popen([sys.executable, "-c", "import sys, time, torch.distributed as d; "
                             "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
                             "print('up', s.port, flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    rank_0 = tmp_path / "rank_0.py"
    rank_0.write_text("""
import sys
from datetime import timedelta

import torch.distributed as dist

from fedpar.server.ranks.group import RankGroup, RankMissing

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=5))
dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=5))
group = RankGroup(5.0, "fedpar/ranks/test")
group.reform([0])  # with the store there, the group forms again
print("formed", group.generation, group.asking_to_join(), flush=True)
sys.stdin.readline()  # the store's host is killed meanwhile
try:
    group.reform([0])
except RankMissing as exc:
    print("missing:", exc, flush=True)
""")
    proc = None
    try:
        up, port = host.stdout.readline().split()
        assert up == "up"
        proc = subprocess.Popen([sys.executable, str(rank_0), port], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "formed 1 {}"
        host.kill()
        host.wait()
        out, err = proc.communicate("go\n", timeout=60)
        assert re.fullmatch(r"missing: the rendezvous store of the aggregator ranks is gone \(.*\); their group "
                            r"cannot be formed again\n", out), out + err
        assert "Traceback" not in err, err
    finally:
        for p in (proc, host):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
