"""kill -9 of a real `fedpar simulate-workers` host, or of a real `fedpar client` agent, while it trains the open tasks
of a round, then the same command again: the new process is handed those tasks of the round still running, so the
round closes with every sampled member's update seconds after the restart, not at its 60 s deadline, and the model
learns; in a secure round, whose key exchange cannot be replayed, the restarted agent counts as failed at once and the
round closes on the others' updates. Real coordinator (in this process) over loopback gRPC, real processes for the
killed and restarted ones."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedpar.aggregation import build_strategy
from fedpar.datasets import load_dataset
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.config import CoordinatorConfig
from support.digit_agents import start_digit_agents
from support.gated_trainer import GatedTrainer

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 60.0  # the rounds here close within seconds of a restart: none waits this out
HOST = "host-0-of-1"  # a launch without torchrun is rank 0 of 1
# an agent's training, seconds of it (~2.5 s on a loaded 2-core box), outlasts the kill that comes 0.3 s into it; every
# member trains it, the held back ones too, so more only makes the round longer (and costs CPU)
LONG_EPOCHS = 40


def _start(args: list[str], log: Path) -> subprocess.Popen:
    """`fedpar ARGS` in a process of its own, writing to ``log`` (a file, not a pipe a full one would block)."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "fedpar", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _until(condition, what: str, proc: subprocess.Popen | None = None, log: Path | None = None,
           timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, log.read_text() if log else proc.returncode
        assert time.monotonic() < end, f"no {what} in {timeout} s"
        time.sleep(0.02)


def _training(server, member_ids) -> bool:
    """Whether the current round's tasks of ``member_ids`` went out (with the small model inline: they train)."""
    state = server.coordinator.current
    slots = [state.slots.get(m) for m in member_ids] if state is not None and not state.closed else [None]
    return all(slot is not None and slot.dispatched and slot.status == "pending" for slot in slots)


def _incarnation(server, agent_id: str) -> str:
    """The incarnation of the process holding ``agent_id``'s session ('' when none does)."""
    record = server.coordinator.registry.get(agent_id)
    return record.incarnation if record is not None else ""


def _stop(*procs: subprocess.Popen | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(180)
def test_a_host_killed_mid_round_and_started_again_gets_its_members_tasks_back(tmp_path):
    clients = 3
    rows: list[dict] = []
    server = CoordinatorAssembly.for_data("mlp", load_dataset("digits"), 0, "cpu").server(
        CoordinatorConfig(min_available=clients, clients_per_round=clients, overselect=1.0, rounds=1,
                          accept_populations=True, deadline_seconds=DEADLINE, heartbeat_seconds=1.0,
                          local_epochs=3),  # steps of at least 0.05 s each: seconds of training, killed 0.3 s into it
        build_strategy("fedavg"), on_round_end=[rows.append])
    server.start()
    # slow steps: the kill comes while the members train; on the CPU, as the agents here (on a GPU box CUDA's
    # start-up in the restarted host counts in the round's seconds)
    host_args = ["simulate-workers", "--server", server.address, "--insecure", "--clients", str(clients),
                 "--dataset", "digits", "--model", "mlp", "--seats", str(clients), "--max-backoff", "0.5",
                 "--slow-fraction", "1", "--slow-step-delay", "0.05", "--device", "cpu"]
    first = again = None
    try:
        first = _start(host_args, tmp_path / "first.log")
        members = [f"client-{i:04d}" for i in range(clients)]
        _until(lambda: _training(server, members), "round 1 training", first, tmp_path / "first.log")
        time.sleep(0.3)
        first.send_signal(signal.SIGKILL)
        first.wait()
        again = _start(host_args, tmp_path / "again.log")  # at once: its task stream was cut, its place is free
        assert again.wait(120) == 0, (tmp_path / "again.log").read_text()
    finally:
        _stop(first, again)
        server.stop()
    said = (tmp_path / "again.log").read_text()
    assert f"{clients} clients hosted, {clients} tasks run" in said and "Traceback" not in said, said
    [row] = rows
    assert (row["status"], row["reported"], row["close_reason"]) == ("ok", clients, "target reached"), row
    assert row["round_seconds"] < DEADLINE / 2, row  # the restart and the members' training again, not the deadline
    assert row["test_accuracy"] > 0.8, row


@pytest.mark.timeout(180)
def test_an_agent_killed_mid_round_and_started_again_gets_its_task_back(tmp_path):
    """Killed while training (its heartbeats stop; no long-poll is open), the same command started again is refused
    until its liveness runs out (--liveness-timeout 2 s here), then joins and is handed its open task, while bob, held
    back, has yet to answer: the round counts both updates."""
    rows: list[dict] = []
    server = CoordinatorAssembly.for_data("mlp", load_dataset("digits"), 0, "cpu").server(
        CoordinatorConfig(min_available=2, clients_per_round=2, overselect=1.0, rounds=1, deadline_seconds=DEADLINE,
                          heartbeat_seconds=0.5, liveness_timeout_seconds=2.0, local_epochs=LONG_EPOCHS),
        build_strategy("fedavg"), on_round_end=[rows.append])
    server.start()
    gate = threading.Event()
    agent_args = ["client", "--insecure", "--server", server.address, "--agent-id", "alice", "--dataset", "digits",
                  "--model", "mlp", "--poll", "1", "--max-backoff", "0.5", "--threads", "1", "--device", "cpu",
                  "--num-partitions", "2", "--partition-index", "0"]
    first = again = None
    try:
        (bob,), threads, errors = start_digit_agents(
            server.port, ["bob"], trainer=lambda _, *args, **kwargs: GatedTrainer(*args, gate=gate, **kwargs))
        first = _start(agent_args, tmp_path / "first.log")
        _until(lambda: _training(server, ["alice"]), "alice training", first, tmp_path / "first.log")
        time.sleep(0.3)
        first_incarnation = _incarnation(server, "alice")
        first.send_signal(signal.SIGKILL)
        first.wait()
        for attempt in range(20):  # the same command again, as a user would after its one-line refusal
            again = _start(agent_args, tmp_path / "again.log")
            _until(lambda: again.poll() is not None or _incarnation(server, "alice") not in ("", first_incarnation),
                   "alice again", timeout=60)
            if again.poll() is None:
                break
            said = (tmp_path / "again.log").read_text()
            free = re.search(r"its place is free in (\d+) s", said)
            assert free, said
            time.sleep(0.5)
        _until(lambda: _training(server, ["alice"]), "alice training again", again, tmp_path / "again.log")
        gate.set()
        assert again.wait(60) == 0, (tmp_path / "again.log").read_text()
        threads[0].join(30)
        assert not errors, errors
    finally:
        gate.set()
        _stop(first, again)
        server.stop()
    [row] = rows
    assert (row["status"], row["reported"], row["close_reason"]) == ("ok", 2, "target reached"), row
    assert row["round_seconds"] < DEADLINE / 2, row  # not the deadline (a CUDA torch takes seconds to start)
    assert row["test_accuracy"] > 0.8, row


def _shared_keys(server, agent_id: str) -> bool:
    """Whether ``agent_id`` shared its keys in the current secure round (its mask is fixed in the others')."""
    secure = server.coordinator.secure
    return secure is not None and secure.server is not None and agent_id in secure.server.shared


@pytest.mark.timeout(180)
def test_a_secure_round_counts_a_restarted_agent_as_failed_and_closes_on_the_others_updates(tmp_path, caplog):
    """Its key exchange cannot be replayed: the agent started again is not handed its task, it counts as failed at
    once (one line), and the round closes as soon as the others, held back until then, upload: its mask is removed
    with the shares they hold, and the model is the mean of theirs."""
    caplog.set_level(logging.INFO, logger="fedpar.server")
    rows: list[dict] = []
    server = CoordinatorAssembly.for_data("mlp", load_dataset("digits"), 0, "cpu").server(
        CoordinatorConfig(min_available=3, clients_per_round=3, overselect=1.0, rounds=1, deadline_seconds=DEADLINE,
                          heartbeat_seconds=0.5, liveness_timeout_seconds=2.0, local_epochs=LONG_EPOCHS,
                          secure_aggregation=True),
        build_strategy("fedavg"), on_round_end=[rows.append])
    server.start()
    gate = threading.Event()
    agent_args = ["client", "--insecure", "--server", server.address, "--agent-id", "alice", "--dataset", "digits",
                  "--model", "mlp", "--poll", "1", "--max-backoff", "0.5", "--threads", "1", "--device", "cpu",
                  "--num-partitions", "3", "--partition-index", "0"]
    first = again = None
    try:
        _, threads, errors = start_digit_agents(
            server.port, ["bob", "carol"], trainer=lambda _, *args, **kwargs: GatedTrainer(*args, gate=gate, **kwargs))
        first = _start(agent_args, tmp_path / "first.log")
        _until(lambda: _shared_keys(server, "alice"), "alice's keys shared", first, tmp_path / "first.log")
        first.send_signal(signal.SIGKILL)
        first.wait()
        for attempt in range(20):  # the same command again, as a user would after its one-line refusal
            again = _start(agent_args, tmp_path / "again.log")
            _until(lambda: again.poll() is not None or any("started again" in r.getMessage() for r in caplog.records),
                   "alice again", timeout=60)
            if again.poll() is None:
                break
            assert "its place is free in" in (tmp_path / "again.log").read_text()
            time.sleep(0.5)
        gate.set()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert again.wait(30) == 0, (tmp_path / "again.log").read_text()
    finally:
        gate.set()
        _stop(first, again)
        server.stop()
    said = [r.getMessage() for r in caplog.records if "started again" in r.getMessage()]
    assert said == ["round 1: agent 'alice' started again; the open task of alice cannot be handed out again (secure "
                    "aggregation's key setup fixed this round's masks): counted as failed"], said
    [row] = rows
    assert (row["status"], row["reported"], row["secagg_dropped"]) == ("ok", 2, 1), row
    assert row["round_seconds"] < DEADLINE / 2, row  # not the deadline (a CUDA torch takes seconds to start)
    assert row["test_accuracy"] > 0.8, row
