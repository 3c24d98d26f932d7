"""A Flower App's ServerApp runs unchanged on fedpar (server/flower_grid.py, server/flower_rounds.py): the same
global arrays as Flower's own ServerApp, strategy and ClientApp driven in one process (tests/flower/reference_grid.py),
and a ClientApp that fails gives that node's error reply while the run goes on."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from fedpar.wording import counted  # noqa: E402
from fedpar.server.final_model import load_final_model  # noqa: E402
from fedpar.simulations.config import SimulationConfig  # noqa: E402
from fedpar.simulations.flower_app_run import flower_app_refusal, run_flower_app  # noqa: E402
from fedpar.tasks.flower_app import load_flower_app  # noqa: E402

from support.flower_reference import run_with_flower  # noqa: E402

APP = Path(__file__).parent / "tiny_app"
TESTED_FLOWER = ("1.41", "1.42")  # the Flower releases this suite ran against (pyproject's flower and test extras)


def test_installed_flower_is_a_tested_release():
    assert version("flwr").rsplit(".", 1)[0] in TESTED_FLOWER, \
        f"flwr {version('flwr')} is untested; run tests/flower and add it to TESTED_FLOWER and pyproject.toml"


def test_server_app_on_fedpar_ends_with_flowers_own_arrays(tmp_path):
    flower_final = tmp_path / "flower.npz"
    run_with_flower(APP, f'final-path="{flower_final}"', num_partitions=3)
    expected = dict(np.load(flower_final))

    fedpar_final = tmp_path / "fedpar.npz"
    overrides = f'final-path="{fedpar_final}"'
    cfg = SimulationConfig(clients=3, workers=1, seats=2, out=str(tmp_path / "out"), deadline_seconds=30.0)
    summary = run_flower_app(cfg, load_flower_app(APP, overrides), overrides)

    saved_by_app = dict(np.load(fedpar_final))
    names, arrays = load_final_model(tmp_path / "out")
    kept_by_fedpar = dict(zip(names, arrays))
    assert set(kept_by_fedpar) == set(expected) == {"w", "b"}
    for name, array in expected.items():
        np.testing.assert_allclose(saved_by_app[name], array, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(kept_by_fedpar[name], array, rtol=1e-5, atol=1e-6)
    from tiny_flower_app.task import initial_arrays  # loaded with the app (its folder is on sys.path now)

    assert not np.allclose(expected["w"], initial_arrays()["w"])  # it trained
    # 2 server rounds of train + evaluate messages: 4 fedpar rounds of 3 messages each, every one answered
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["flower_round"], r["message_type"], r["sampled"], r["reported"]) for r in rows] == \
        [(1, "train", 3, 3), (1, "evaluate", 3, 3), (2, "train", 3, 3), (2, "evaluate", 3, 3)]
    assert summary["rounds"] == 4 and summary["flower"]["train_metrics_clientapp"]["2"]["rounds"] == pytest.approx(2.0)  # Context.state kept


def test_a_failing_client_app_is_that_nodes_error_reply_and_the_run_goes_on(tmp_path):
    overrides = "fail-partition=1"
    cfg = SimulationConfig(clients=3, workers=1, seats=1, out=str(tmp_path / "out"), deadline_seconds=30.0)
    summary = run_flower_app(cfg, load_flower_app(APP, overrides), overrides)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reported"] for r in rows if r["message_type"] == "train"] == [3, 3]  # error replies are replies
    assert [(r["status"], r["error_replies"]) for r in rows if r["message_type"] == "train"] == [("ok", 1)] * 2
    assert summary["rounds"] == 4
    # FedAvg aggregated the two good replies: partitions 0 and 2 alone
    names, arrays = load_final_model(tmp_path / "out")
    assert np.isfinite(np.concatenate([a.ravel() for a in arrays])).all()


def test_settings_a_server_app_run_cannot_honour_are_refused_in_one_line():
    line = flower_app_refusal(SimulationConfig(clients=3, secure_aggregation=True))
    assert "--secure-aggregation" in line and "--strategy" in line and "\n" not in line
    assert "--task" in flower_app_refusal(SimulationConfig(clients=3, task="own_task.py:make"))
    assert "--checkpoint-dir" in flower_app_refusal(SimulationConfig(clients=3, checkpoint_dir="ckpt"))  # no resume
    assert flower_app_refusal(SimulationConfig(clients=3)) is None



@pytest.mark.parametrize("command, extra", [(["simulate", "--clients", "2"], ["--privacy", "central"]),
                                            (["serve", "--insecure", "--port", "0"], ["--privacy", "central"]),
                                            (["serve", "--insecure", "--port", "0"], ["--max-agent-share", "0.5"])])
def test_privacy_and_share_caps_a_server_app_cannot_apply_are_refused_not_dropped(command, extra, capsys):
    """They were ignored: a user who asked for DP got Flower's plain FedAvg, exit 0 (QA)."""
    from fedpar.cli.main import main

    assert main([*command, "--flower-app", str(APP), *extra]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1 and extra[0] in lines[0] and "ServerApp" in lines[0], lines


def test_a_server_app_waiting_for_more_nodes_than_clients_stops_in_one_line(tmp_path, monkeypatch):
    # the ServerApp starts once the members are live: a shorter patience still outlasts a node that could come
    monkeypatch.setattr("fedpar.simulations.flower_app_run.NODE_PATIENCE_SECONDS", 1.0)
    cfg = SimulationConfig(clients=1, workers=1, seats=1, out=str(tmp_path / "out"))  # the app's FedAvg wants 2
    from fedpar.task import TaskFailed

    with pytest.raises(TaskFailed, match=r"waited 1 s for more than the 1 nodes it has .*start more clients"):
        run_flower_app(cfg, load_flower_app(APP))


@pytest.mark.parametrize("options, said", [
    (["--clients", "1"], "fedpar simulate: the ServerApp waited 1 s for more than the 1 nodes it has"),
    (["--clients", "2", "--run-config", 'num-server-rounds="two"'],
     "fedpar simulate: the ServerApp failed: ValueError: invalid literal for int() with base 10: 'two': fix the app")])
def test_a_server_app_that_fails_is_one_line_with_no_coordinator_traceback(tmp_path, options, said, capfd,
                                                                           monkeypatch):
    """They printed 'coordinator stopped with an error' and a traceback first; an exception of Flower's own kind
    (not a ValueError or RuntimeError) escaped as two tracebacks (QA)."""
    from support.in_process import run_main

    monkeypatch.setattr("fedpar.simulations.flower_app_run.NODE_PATIENCE_SECONDS", 1.0)  # its members are live

    done = run_main(["simulate", "--flower-app", str(APP), "--workers", "1", *options, "--out",
                     str(tmp_path / "out")], capfd)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith(said) and "stopped with an error" not in done.stderr, done.stderr[-3000:]


def test_the_docs_command_runs_the_example_app_on_fedpar(tmp_path, capsys):
    from fedpar.cli.main import main

    example = Path(__file__).resolve().parents[2] / "examples" / "flower_app"
    code = main(["simulate", "--flower-app", str(example), "--run-config", "num-server-rounds=1", "--clients", "3",
                 "--workers", "1", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["failed_rounds"] == 0  # one train and one evaluate round
    evaluated = summary["flower"]["evaluate_metrics_serverapp"]  # the app's global evaluation, before and after
    assert set(evaluated) == {"0", "1"} and 0.0 <= evaluated["1"]["accuracy"] <= 1.0
    names, arrays = load_final_model(tmp_path / "out")
    assert names[0] == "fc1.weight" and arrays[0].shape == (32, 64)


def test_a_flower_round_whose_every_reply_is_an_error_failed():
    """It was counted ok when every ClientApp raised (QA round 2)."""
    from flwr.app import Message, RecordDict
    from flwr.app import Error

    from fedpar.server.flower_rounds import exchange_status

    sent = Message(RecordDict(), dst_node_id=1, message_type="train")
    failed = Message(Error(code=0, reason="boom"), reply_to=sent)
    answered = Message(RecordDict(), reply_to=sent)
    assert exchange_status([failed, failed], 2) == "failed" and exchange_status([], 2) == "failed"
    assert exchange_status([failed, answered], 2) == "ok" and exchange_status([], 0) == "ok"


def test_a_client_app_slower_than_the_deadline_is_no_reply_not_a_traceback(tmp_path, capfd):
    """A member whose reply came after its round closed died of a NameError in client/runtime.py (a traceback per
    member; a deployed agent exited 1) (QA)."""
    from support.in_process import run_main

    done = run_main(["simulate", "--flower-app", str(APP), "--run-config", "num-server-rounds=1 train-seconds=1.5",
                     "--deadline", "1", "--clients", "2", "--workers", "1", "--out", str(tmp_path / "out")], capfd)
    # nothing was trained, which the run's one line says (it ended with exit 0 and the initial arrays as the model)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "fedpar simulate: no node answered the ServerApp's train messages with a model, so nothing was trained: no "
        "node replied before the round's deadline"), done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["message_type"], r["reported"]) for r in rows] == [("train", 0), ("evaluate", 2)]


def test_ctrl_c_stops_a_server_app_simulation_writing_what_completed(tmp_path):
    """It wrote neither summary.json nor the model, and printed a traceback of the Grid's (QA)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "fedpar", "simulate", "--flower-app", str(APP), "--workers", "1",
                             "--clients", "2", "--run-config", "num-server-rounds=100000", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end and proc.poll() is None and \
                len((out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []) < 4:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("fedpar simulate: interrupted after")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["rounds"] >= 4
    # the log's warning counted the same Message exchanges as 'completed rounds', then the last line said exchanges
    warned = [line for line in err.splitlines() if "interrupted: stopping after" in line]
    assert len(warned) == 1 and warned[0].endswith(f"interrupted: stopping after {summary['rounds']} Message "
                                                   "exchanges (a ServerApp's round is usually two: train and "
                                                   "evaluate)"), warned
    assert err.strip().splitlines()[-1] == f"fedpar simulate: interrupted after {counted(summary['rounds'], 'Message exchange')}"
    names, arrays = load_final_model(out)  # the global model the last round's messages carried, not a stand-in
    assert sorted(names) == ["b", "w"]
