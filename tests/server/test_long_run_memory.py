"""A coordinator's memory is bounded by its configuration, not its history: a real `fedpar serve` restarted on a
checkpoint folder whose metrics.jsonl holds 100,000 rounds resumes at the right round with the memory of a fresh
one (issue 33: a restart used to read every row back, about 3 KiB each)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from fedpar.models import get_weights
from fedpar.models.for_data import build_model_for_data
from fedpar.models.weights import weight_specs
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.run_logs import RunningSummary
from fedpar.protocol.tensorfile import load_tensors
from fedpar.server.checkpoint import Checkpoint, save_checkpoint
from support.scripted_agent import ScriptedAgent

ROOT = Path(__file__).resolve().parents[2]
HISTORY = 100_000
SLACK_MIB = 20


def _serve(tmp: Path, rounds: int) -> subprocess.Popen:
    """`fedpar serve` of the digits MLP, checkpoints in tmp/ckpt, outputs in tmp/out, one agent per round."""
    (tmp / "port").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "fedpar.cli.main", "serve", "--insecure", "--port", "0", "--port-file",
           str(tmp / "port"), "--checkpoint-dir", str(tmp / "ckpt"), "--out", str(tmp / "out"), "--rounds", str(rounds),
           "--min-available", "1", "--clients-per-round", "1", "--overselect", "1.0", "--deadline", "60",
           "--heartbeat", "1", "--liveness-timeout", "10",
           "--device", "cpu"]  # a CUDA context (~0.5 GiB resident on a GPU box, its own growth) is not the history's
    with open(tmp / "serve.log", "a") as log:  # a file, not a pipe: a full pipe would block the server
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                stderr=subprocess.STDOUT)


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def _last_round(path: Path) -> int:
    """The round of metrics.jsonl's last complete line (0: none), read from its end."""
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with path.open("rb") as fh:
        fh.seek(max(0, path.stat().st_size - 4096))
        lines = fh.read().splitlines(keepends=True)
    complete = [line for line in lines if line.endswith(b"\n")]
    return json.loads(complete[-1])["round"] if complete else 0


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _one_round(tmp: Path, rounds: int, expected_round: int) -> float:
    """Serve, let one agent complete round ``expected_round`` (the process's first), and return the coordinator's
    RSS in MiB once that round is logged (the next round is open by then); the process is killed afterwards."""
    server = _serve(tmp, rounds)
    agent = None
    try:
        _wait_for(lambda: (tmp / "port").exists() or server.poll() is not None, 120, "serve did not start")
        assert server.poll() is None, (tmp / "serve.log").read_text()
        model = build_model_for_data("mlp", (1, 8, 8), 10)
        names = [n for n, _, _ in weight_specs(model)]
        layout = ModelLayout.of_arrays(names, get_weights(model))
        agent = _join(f"127.0.0.1:{int((tmp / 'port').read_text())}")
        task = agent.task(timeout=60)
        assert task.round == expected_round
        weights = agent.download(task, layout)
        assert agent.upload(task, [w + np.float32(0.01) for w in weights], 100, names=names).accepted
        metrics = tmp / "out" / "metrics.jsonl"
        _wait_for(lambda: _last_round(metrics) == expected_round, 60, f"round {expected_round} was not logged")
        time.sleep(1.0)  # its checkpoint and the next round's opening are done by now
        return _rss_mib(server.pid)
    finally:
        if agent is not None:
            agent.close()
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
        server.wait(10)


def _join(address: str) -> ScriptedAgent:
    """An agent joined to ``address``, once the coordinator is done restoring its checkpoint (UNAVAILABLE before)."""
    end = time.monotonic() + 120
    while True:
        try:
            return ScriptedAgent(address, "only", num_examples=100)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                raise
            time.sleep(0.1)


def _fake_history(tmp: Path) -> None:
    """Turn tmp's one-round run into a 100,000-round one: metrics.jsonl and metrics.csv with a row per round, and
    a checkpoint of round 100,000 (round 1's model and state, with that round's row and the run's summary)."""
    out, ckpt = tmp / "out", tmp / "ckpt"
    template = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    with (out / "metrics.csv").open() as fh:
        columns = next(csv.reader(fh))
    summary = RunningSummary()
    with (out / "metrics.jsonl").open("w") as lines, (out / "metrics.csv").open("w", newline="") as table:
        cells = csv.DictWriter(table, columns, lineterminator="\n")
        cells.writeheader()
        for r in range(1, HISTORY + 1):
            row = {**template, "round": r, "cohort_digest": f"{r:016x}", "wall_seconds": 3.0 * r}
            lines.write(json.dumps(row) + "\n")
            cells.writerow({k: "" if v is None else v for k, v in row.items()})
            summary.add(row)
    first = ckpt / "round-000001"
    names, arrays, _ = load_tensors(first / "global.safetensors")
    keys, strategy_arrays, _ = load_tensors(first / "strategy.safetensors")
    state = json.loads((first / "state.json").read_text())
    state.pop("round")
    # the checkpoint keeps its round's row as logged: a resume checks it against --out's (another run's rows?)
    state.update(metrics_row=row, metrics_summary=summary.state())
    save_checkpoint(ckpt, Checkpoint(HISTORY, names, arrays, dict(zip(keys, strategy_arrays)), state))


def test_a_restart_on_100000_rounds_of_history_uses_the_memory_of_a_fresh_coordinator(tmp_path):
    fresh = _one_round(tmp_path, rounds=3, expected_round=1)
    _fake_history(tmp_path)
    size = (tmp_path / "out" / "metrics.jsonl").stat().st_size
    resumed = _one_round(tmp_path, rounds=HISTORY + 3, expected_round=HISTORY + 1)

    log = (tmp_path / "serve.log").read_text()
    assert f"resumed from checkpoint after round {HISTORY}" in log
    assert abs(resumed - fresh) <= SLACK_MIB, (fresh, resumed, size)
    with (tmp_path / "out" / "metrics.jsonl").open("rb") as fh:
        assert sum(1 for _ in fh) == HISTORY + 1
    with (tmp_path / "out" / "metrics.csv").open("rb") as fh:
        assert sum(1 for _ in fh) == HISTORY + 2  # the header, and not rewritten: appended
    assert _last_round(tmp_path / "out" / "metrics.jsonl") == HISTORY + 1
