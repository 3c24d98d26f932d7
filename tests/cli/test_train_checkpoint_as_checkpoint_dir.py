"""`fedpar serve` and `fedpar simulate` given a --checkpoint-dir that holds `fedpar train`'s checkpoints (or is that
command's --out folder) refuse it in one line naming what it is, before anything is made or started. They took it:
their rounds' checkpoints went in beside the trainer's (QA: `round-000001`, `LATEST` and `run.json` next to
`step-00000010` and `latest`). Real checkpoints, made by real `fedpar train` runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.in_process import main_here, run_main
from support.own_task import EXAMPLE, write_table

OWN = "give --checkpoint-dir a folder of its own (a new one starts the run over)"
COMMANDS = {
    "serve": ["serve", "--insecure", "--port", "0", "--rounds", "1", "--no-central-eval"],
    "simulate": ["simulate", "--clients", "2", "--rounds", "1", "--workers", "1", "--quiet"],
}


def _train(out: Path, *how: str) -> Path:
    """A real `fedpar train` run into ``out`` that keeps a checkpoint; its checkpoint folder."""
    done = main_here("train", "--device", "cpu", "--no-plot", "--out", str(out), *how)
    assert done.returncode == 0, done.stderr
    return out / "checkpoints"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """The zoo trainer's step checkpoints and a task's epoch checkpoints."""
    tmp = tmp_path_factory.mktemp("trained")
    steps = _train(tmp / "steps", "--model", "mlp", "--dataset", "digits", "--batch-size", "64", "--max-steps", "10",
                   "--checkpoint-every", "10")
    csv = write_table(tmp / "table.csv")
    epochs = _train(tmp / "epochs", "--task", EXAMPLE, "--task-option", f"csv={csv}", "--epochs", "1",
                    "--checkpoint-every", "1")
    assert sorted(p.name for p in steps.iterdir() if p.is_dir()) == ["step-00000010"]
    assert sorted(p.name for p in epochs.iterdir() if p.is_dir()) == ["epoch-000001"]
    return {"steps": steps, "epochs": epochs}


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*")}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("kind, name", [("steps", "step-00000010"), ("epochs", "epoch-000001")])
def test_a_folder_of_fedpar_train_checkpoints_is_refused_before_anything_is_made(trained, tmp_path, command, kind,
                                                                                 name, capfd):
    folder = trained[kind]
    before = _snapshot(folder.parent)
    out = tmp_path / "out"
    # In this process (a serve that took the folder would wait for agents: pytest's timeout ends it)
    done = run_main([*COMMANDS[command], "--checkpoint-dir", str(folder), "--out", str(out)], capfd)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.splitlines() == [
        f"fedpar {command}: --checkpoint-dir {folder} holds checkpoints of `fedpar train` (centralized training: "
        f"{name}), not of a federated run; {OWN}"], done.stderr
    assert _snapshot(folder.parent) == before  # no round, LATEST, run.json or lock file among the trainer's
    assert not out.exists()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_out_folder_of_a_fedpar_train_run_is_refused_too(trained, tmp_path, command, capfd):
    folder = trained["steps"].parent
    before = _snapshot(folder)
    done = run_main([*COMMANDS[command], "--checkpoint-dir", str(folder), "--out", str(tmp_path / "out")], capfd)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [
        f"fedpar {command}: --checkpoint-dir {folder} is the --out folder of a `fedpar train` run (its checkpoints "
        f"are in {folder / 'checkpoints'}), not a federated run's checkpoints; {OWN}"], done.stderr
    assert _snapshot(folder) == before and not (tmp_path / "out").exists()


def test_a_new_folder_and_a_federated_runs_own_checkpoints_are_still_taken(tmp_path):
    folder = tmp_path / "ckpt"
    for rounds in ("1", "2"):  # made, then resumed
        done = main_here("simulate", "--clients", "2", "--rounds", rounds, "--workers", "1", "--quiet",
                         "--checkpoint-dir", str(folder), "--out", str(tmp_path / "out"))
        assert done.returncode == 0, done.stderr
    assert (folder / "LATEST").read_text() == "round-000002"
