"""`fedpar train` resumes a checkpoint only with the layout and model it was written with: another one is refused in
one line before any rank starts; a checkpoint of older code (no record) still resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedpar.cli.main import main


def _train(out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "mlp", "--dataset", "digits", "--device", "cpu", "--batch-size", "64",
            "--checkpoint-every", "2", "--no-plot", "--out", str(out), *extra]


def _no_constant(name: str):
    """json.loads' parse_constant for strict JSON: NaN, Infinity and -Infinity are refused."""
    raise ValueError(f"{name} is not a JSON number")


@pytest.fixture
def checkpointed(tmp_path, monkeypatch, capsys) -> Path:
    """A one-rank run of 2 steps, checkpointed after them."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    assert main(_train(out, "--max-steps", "2")) == 0
    capsys.readouterr()
    return out


@pytest.mark.parametrize("extra, difference", [
    (["--nproc", "2", "--dp-replicate", "2"], "--nproc 1, not 2; --dp-replicate 1, not 2"),
    (["--nproc", "2", "--dp-replicate", "1", "--fsdp", "2"], "--nproc 1, not 2; --fsdp 1, not 2"),
    (["--model-arg", "hidden=[32]"], "--model-arg none, not hidden=[32]"),
    # the optimizer's state or the model's input shape did not load: a traceback of DCP's, then 'it is damaged'
    (["--optimizer", "adamw"], "--optimizer sgd, not adamw"),
    (["--dataset", "synthetic:0.5:0.5:4", "--batch-size", "16"], "--dataset digits, not synthetic:0.5:0.5:4"),
])
def test_a_resume_with_another_layout_or_model_is_refused_in_one_line(checkpointed, capsys, extra, difference):
    code = main(_train(checkpointed, "--max-steps", "4", *extra))
    lines = capsys.readouterr().err.strip().splitlines()
    assert (code, len(lines)) == (2, 1), lines
    assert lines[0].startswith(f"fedpar train: cannot resume from {checkpointed / 'checkpoints' / 'step-00000002'}: "
                               f"it was made with {difference};"), lines
    assert lines[0].endswith(f"pass --no-resume to start afresh in {checkpointed} (or another --out)"), lines
    assert json.loads((checkpointed / "summary.json").read_text())["steps"] == 2  # nothing ran


def test_the_same_settings_resume_and_no_resume_starts_afresh(checkpointed, capsys):
    assert main(_train(checkpointed, "--max-steps", "4")) == 0
    assert json.loads((checkpointed / "summary.json").read_text())["resumed_from_step"] == 2
    assert main(_train(checkpointed, "--max-steps", "2", "--model-arg", "hidden=[32]", "--no-resume")) == 0
    assert json.loads((checkpointed / "summary.json").read_text())["resumed_from_step"] == 0


def test_a_checkpoint_of_older_code_without_its_record_still_resumes(checkpointed, capsys):
    (checkpointed / "checkpoints" / "step-00000002" / "run.json").unlink()
    assert main(_train(checkpointed, "--max-steps", "4")) == 0
    assert json.loads((checkpointed / "summary.json").read_text())["resumed_from_step"] == 2


@pytest.mark.parametrize("max_steps", ["2", "1"])
def test_resuming_a_finished_run_says_so_and_logs_no_second_final_eval(checkpointed, capsys, max_steps):
    outputs = ("metrics.jsonl", "metrics.csv", "summary.json", "global.safetensors", "global.json")
    before = {name: (checkpointed / name).read_bytes() for name in outputs}
    assert main(_train(checkpointed, "--max-steps", max_steps)) == 0
    said = capsys.readouterr().out
    assert (f"the checkpoint is at step 2, already at or after the run's last step {max_steps}: nothing to train "
            "(raise --max-steps to train on, or pass --no-resume to start afresh)") in said
    assert f"its outputs in {checkpointed} are left as they are" in said and "wrote summary.json" not in said
    assert "steps of 64 examples" not in said
    # the final eval row is there once; the summary kept its loss and speed (it was rewritten with NaN and zeros)
    assert {name: (checkpointed / name).read_bytes() for name in outputs} == before


def test_a_finished_run_stopped_before_its_outputs_writes_them_in_strict_json(checkpointed, capsys):
    """Killed after its last checkpoint, before its summary: the resume writes it, its loss the last one logged."""
    logged = [json.loads(line) for line in (checkpointed / "metrics.jsonl").read_text().splitlines()]
    (checkpointed / "summary.json").unlink()
    assert main(_train(checkpointed, "--max-steps", "2")) == 0
    assert "wrote summary.json" in capsys.readouterr().out
    summary = json.loads((checkpointed / "summary.json").read_text(), parse_constant=_no_constant)
    assert summary["steps"] == 2 and summary["samples_per_second"] == 0.0
    assert summary["final_train_loss"] == [r["loss"] for r in logged if r["kind"] == "train"][-1]


def test_summaries_and_metrics_lines_are_strict_json(tmp_path):
    """NaN and infinities are no JSON numbers: strict parsers refused the files; they are written as null."""
    from fedpar.parallel.metrics import StepMetricsLog, write_json_atomic

    write_json_atomic(tmp_path / "summary.json", {"loss": float("nan"), "peaks": [1.0, float("inf")],
                                                  "config": {"lr": float("-inf"), "steps": 2}})
    assert (json.loads((tmp_path / "summary.json").read_text(), parse_constant=_no_constant)
            == {"loss": None, "peaks": [1.0, None], "config": {"lr": None, "steps": 2}})
    log = StepMetricsLog(tmp_path, True)
    log.write({"kind": "eval", "step": 1, "val_loss": float("nan")})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"kind": "eval", "step": 1, "val_loss": null}\n'
