"""Mistakes of a Flower App whose ServerApp drives the run (``fedpar simulate --flower-app`` without
``--strategy``), run by real worker processes over loopback gRPC: they never reach the global model, and a ServerApp
that runs no round says so in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from fedpar.server.final_model import load_final_model  # noqa: E402
from fedpar.simulations.config import SimulationConfig  # noqa: E402
from fedpar.simulations.flower_app_run import run_flower_app  # noqa: E402
from fedpar.tasks.flower_app import load_flower_app  # noqa: E402
from support.in_process import run_main  # noqa: E402

APP = Path(__file__).parent / "tiny_app"


def test_a_client_apps_nan_arrays_are_its_error_reply_and_never_reach_the_global_model(tmp_path):
    """The ServerApp's FedAvg averaged them in: global.safetensors held NaN, exit 0 (QA)."""
    overrides = "nan-partition=1"
    cfg = SimulationConfig(clients=3, workers=1, seats=1, out=str(tmp_path / "out"), deadline_seconds=30.0)
    run_flower_app(cfg, load_flower_app(APP, overrides), overrides)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["status"], r["error_replies"], r["rejected"]) for r in rows if r["message_type"] == "train"] == \
        [("ok", 1, 1)] * 2
    names, arrays = load_final_model(tmp_path / "out")
    assert names == ["w", "b"] and all(np.isfinite(a).all() for a in arrays)


def test_a_server_app_that_sends_no_message_stops_in_one_line(tmp_path, capfd):
    """It ended at once with exit 0, only summary.json written and no word that no round ran (QA)."""
    done = run_main(["simulate", "--flower-app", str(APP), "--run-config",
                     "send-nothing=true", "--clients", "2", "--workers", "1", "--out", str(tmp_path / "out")], capfd)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith("fedpar simulate: the ServerApp's main returned without sending a Message, so no "
                                "round ran"), done.stderr[-3000:]


def test_a_server_app_whose_train_messages_all_get_error_replies_stops_in_one_line(tmp_path, capfd):
    """Every train reply an error (one ClientApp raised, the other sent NaN): it ended with exit 0 and the initial
    arrays as global.safetensors, the reasons only in Flower's INFO lines (QA)."""
    done = run_main(["simulate", "--flower-app", str(APP), "--run-config",
                     "num-server-rounds=1 fail-partition=0 nan-partition=1", "--clients", "2", "--workers", "1",
                     "--out", str(tmp_path / "out")], capfd)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    said = lines[-1]
    assert said.startswith("fedpar simulate: no node answered the ServerApp's train messages with a model, so nothing "
                           "was trained: every reply was an error, e.g. ") and said.endswith(": fix the app"), said
    assert "this partition fails on purpose" in said or "holds NaN or Inf" in said, said
    assert not (tmp_path / "out" / "global.safetensors").exists()


def test_a_client_app_reply_too_large_to_travel_is_its_error_reply_at_once(tmp_path, capfd):
    """Each member's upload failed quietly (RESOURCE_EXHAUSTED, logged at INFO), so the round waited out its whole
    deadline and the run said no node replied in time: give it more time (QA)."""
    done = run_main(["simulate", "--flower-app", str(APP), "--run-config",
                     "num-server-rounds=1 pad-reply=400000", "--clients", "2", "--workers", "1",
                     "--deadline", "120", "--out", str(tmp_path / "out")], capfd)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "every reply was an error, e.g. ClientApp of client-000" in lines[-1], done.stderr[-3000:]
    assert "train reply of 1,600," in lines[-1] and "over the 1,048,576-byte limit of one message (the " \
        "coordinator's --max-chunk-bytes): send less, or raise it (at most 64 MiB)" in lines[-1], lines[-1]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["error_replies"], r["close_reason"]) for r in rows if r["message_type"] == "train"] == \
        [(2, "target reached")]  # at once, not at the deadline


@pytest.mark.parametrize("flags, said", [(["--client-batching"], "--client-batching"),
                                         (["--task", "examples/own_task.py:make"], "--task")])
def test_a_setting_strategy_would_not_help_is_not_told_to_add_strategy(flags, said, tmp_path, capfd):
    """It said 'or add --strategy NAME to let fedpar drive', and with --strategy fedavg it was refused still (QA)."""
    for strategy in ([], ["--strategy", "fedavg"]):
        done = run_main(["simulate", "--flower-app", str(APP), *flags, *strategy, "--clients", "2", "--quiet",
                         "--out", str(tmp_path / "out")], capfd)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and said in lines[0] and "--strategy NAME" not in lines[0], lines
