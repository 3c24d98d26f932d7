"""`fedpar train --task --checkpoint-every K`: a checkpoint after the epoch that passes each K steps
(parallel/epoch_checkpoint.py), and the same command resumes from the latest, ending exactly like an uninterrupted
run; a checkpoint of another task or a damaged one is refused in one line before training."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedpar.cli.main import main
from support.own_task import EXAMPLE, write_table


@pytest.fixture
def common(tmp_path):
    csv = write_table(tmp_path / "table.csv")
    return ["train", "--task", EXAMPLE, "--task-option", f"csv={csv}", "--task-option", "hidden=8", "--lr", "0.05",
            "--batch-size", "32", "--no-plot", "--device", "cpu"]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_stopped_after_two_epochs_resumes_and_ends_like_an_uninterrupted_one(common, tmp_path, capsys):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main([*common, "--epochs", "4", "--out", str(whole)]) == 0
    assert not (whole / "checkpoints").exists()  # --checkpoint-every 0 (the default): none
    assert main([*common, "--epochs", "2", "--checkpoint-every", "1", "--out", str(parts)]) == 0
    kept = sorted(p.name for p in (parts / "checkpoints").iterdir())
    assert kept == ["epoch-000001", "epoch-000002", "latest"], kept
    capsys.readouterr()
    assert main([*common, "--epochs", "4", "--checkpoint-every", "1", "--out", str(parts)]) == 0
    said = capsys.readouterr()
    assert f"resumed from {parts / 'checkpoints' / 'epoch-000002'} after epoch 1 (step " in said.out + said.err
    one, two = load_file(whole / "global.safetensors"), load_file(parts / "global.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_array_equal(two[name], one[name])
    assert [(r["kind"], r["epoch"], r["step"]) for r in _rows(parts)] == \
        [(r["kind"], r["epoch"], r["step"]) for r in _rows(whole)]
    summary = json.loads((parts / "summary.json").read_text())
    assert (summary["epochs"], summary["resumed_from_epoch"]) == (4, 2)
    assert summary["steps"] == json.loads((whole / "summary.json").read_text())["steps"]
    assert sorted(p.name for p in (parts / "checkpoints").iterdir()) == ["epoch-000003", "epoch-000004", "latest"]


def test_no_resume_starts_afresh_and_another_task_or_a_damaged_checkpoint_is_refused(common, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*common, "--epochs", "1", "--checkpoint-every", "1", "--out", str(out)]) == 0
    assert main([*common, "--epochs", "1", "--no-resume", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_epoch"] == 0
    assert not (out / "checkpoints" / "latest").exists()  # the earlier run's, let go: no resume takes it up
    assert main([*common, "--epochs", "1", "--checkpoint-every", "1", "--no-resume", "--out", str(out)]) == 0
    capsys.readouterr()
    checkpoint = out / "checkpoints" / "epoch-000001"
    record = checkpoint / "run.json"
    saved = json.loads(record.read_text())
    saved["defining"]["--task"] = "someone else's"
    record.write_text(json.dumps(saved))
    assert main([*common, "--epochs", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fedpar train: cannot resume from {checkpoint}: it was made with --task someone else's, "
                          "not "), err
    assert err.endswith(f"pass --no-resume to start afresh in {out} (or another --out)"), err
    saved["defining"].pop("--task")
    record.write_text(json.dumps(saved))
    (checkpoint / "model.safetensors").write_bytes(b"\x00" * 12)
    assert main([*common, "--epochs", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fedpar train: cannot resume from {checkpoint}: its model.safetensors is damaged ("), err
    assert err.endswith(f"pass --no-resume to start afresh in {out} (or another --out)") and "\n" not in err, err


def test_a_finished_run_resumed_says_so_and_keeps_its_figures_and_a_torn_metrics_line_is_dropped(common, tmp_path,
                                                                                                  capsys):
    out = tmp_path / "out"
    assert main([*common, "--epochs", "2", "--checkpoint-every", "1", "--out", str(out)]) == 0
    before = json.loads((out / "summary.json").read_text())
    assert "test_loss" in before
    capsys.readouterr()
    for epochs in ("2", "1"):  # the same command again, then a lower --epochs: nothing to train, said
        assert main([*common, "--epochs", epochs, "--checkpoint-every", "1", "--out", str(out)]) == 0
        said = capsys.readouterr()
        assert "already at or after the run's last epoch" in said.out + said.err and "nothing to train" in \
            said.out + said.err
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["epochs"], summary["test_loss"], summary["final_train_loss"]) == \
            (2, before["test_loss"], before["final_train_loss"])
        assert json.loads((out / "global.json").read_text())["metrics"]["test_loss"] == before["test_loss"]
    rows = _rows(out)
    with (out / "metrics.jsonl").open("a") as fh:
        fh.write('{"kind": "train", "st')  # a line torn by a kill -9 as it was written
    assert main([*common, "--epochs", "3", "--checkpoint-every", "1", "--out", str(out)]) == 0
    assert _rows(out)[:len(rows)] == rows and len(_rows(out)) == len(rows) + 2


def test_a_damaged_latest_names_the_complete_checkpoint_before_it_and_a_zoo_checkpoint_is_named_so(common, tmp_path,
                                                                                                   capsys):
    out = tmp_path / "out"
    assert main([*common, "--epochs", "2", "--checkpoint-every", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    checkpoints = out / "checkpoints"
    (checkpoints / "epoch-000002" / "state.safetensors").write_bytes(b"\x00" * 12)  # a damaged newest one
    assert main([*common, "--epochs", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"write epoch-000001 into {checkpoints / 'latest'} to resume the one before it, or pass "
                        f"--no-resume to start afresh in {out} (or another --out)"), err
    (checkpoints / "latest").write_text("epoch-000001\n")
    assert main([*common, "--epochs", "3", "--checkpoint-every", "1", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_epoch"] == 1
    capsys.readouterr()
    (checkpoints / "latest").write_text("step-00000002\n")  # a `fedpar train --model ...` run's, in the same --out
    assert main([*common, "--epochs", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"fedpar train: {checkpoints / 'latest'} names step-00000002, a checkpoint of `fedpar train` "
                   f"without --task (its zoo trainer's), not of a task's epochs; pass --no-resume to start afresh in "
                   f"{out} (or another --out)"), err


def test_a_task_file_named_relatively_resumes_when_named_by_its_absolute_path(common, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    absolute = common[common.index("--task") + 1]
    folder, name = absolute.rsplit("/", 1)
    monkeypatch.chdir(folder)
    relative = [*common[:common.index("--task") + 1], name, *common[common.index("--task") + 2:]]
    assert main([*relative, "--epochs", "1", "--checkpoint-every", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # the same file, named from elsewhere
    assert main([*common, "--epochs", "2", "--checkpoint-every", "1", "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert f"resumed from {out / 'checkpoints' / 'epoch-000001'} after epoch 0" in said.out + said.err, said
