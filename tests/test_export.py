"""`fedpar export`: a kept global model (or a checkpoint's) becomes a torch state_dict the model loads."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedpar.cli.main import main
from fedpar.models import get_weights, weight_specs
from fedpar.models.for_data import build_model_for_data
from fedpar.protocol.model_file import write_final_model
from support.in_process import run_main

DESCRIPTION = {"model": "cnn", "dataset": "digits", "input_shape": [1, 8, 8], "num_classes": 10}


def _kept_model(out) -> list[np.ndarray]:
    torch.manual_seed(5)
    model = build_model_for_data("cnn", (1, 8, 8), 10)
    weights = get_weights(model)
    assert write_final_model(out, [n for n, _, _ in weight_specs(model)], weights, 3, DESCRIPTION,
                             {"round": 3, "status": "ok", "test_loss": float("nan")})
    return weights


def test_export_of_an_out_folder_loads_into_the_model_it_describes(tmp_path, capsys):
    weights = _kept_model(tmp_path / "run")
    info = json.loads((tmp_path / "run" / "global.json").read_text())
    assert info == {"round": 3, "interrupted": False, "tensors": "global.safetensors", "model": DESCRIPTION,
                    "metrics": {"round": 3, "status": "ok", "test_loss": None}}
    for source in (tmp_path / "run", tmp_path / "run" / "global.safetensors"):
        target = tmp_path / "exported" / "model.pt"
        assert main(["export", str(source), "--to", str(target)]) == 0
        assert f"wrote {target}: 8 tensors" in capsys.readouterr().out
        model = build_model_for_data(info["model"]["model"], tuple(info["model"]["input_shape"]),
                                     info["model"]["num_classes"])
        model.load_state_dict(torch.load(target, weights_only=True))  # strict: every entry, by name
        assert all(np.array_equal(t.numpy(), w) for t, w in zip(model.state_dict().values(), weights))


def test_nothing_is_kept_before_the_first_round(tmp_path):
    assert not write_final_model(tmp_path / "run", ["w"], [np.ones(2, np.float32)], 0, {}, None)
    assert not (tmp_path / "run").exists()


def test_a_coordinator_stopped_while_closing_a_round_keeps_its_model_without_a_metrics_row(tmp_path):
    from types import SimpleNamespace

    from fedpar.server.final_model import write_coordinator_model

    rows = [{"round": 1, "status": "ok"}]
    for round_id, metrics in ((1, rows[0]), (2, None)):  # round 2's model is made, its row not yet logged
        state = SimpleNamespace(names=["w"], weights=[np.full(2, round_id, np.float32)], round_id=round_id,
                                metrics=SimpleNamespace(last=rows[-1]))
        assert write_coordinator_model(tmp_path, state, {"model": "x"}, interrupted=True)
        info = json.loads((tmp_path / "global.json").read_text())
        assert (info["round"], info["metrics"], info["interrupted"]) == (round_id, metrics, True)


def test_export_errors_are_one_line_and_a_non_zero_exit(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    _kept_model(tmp_path / "run")
    cases = [([str(tmp_path / "nowhere")], f"{tmp_path / 'nowhere'} does not exist; give a run's --out folder"),
             ([str(tmp_path / "notes.txt")], f"{tmp_path / 'notes.txt'} is not a fedpar model: "
                                             f"{tmp_path / 'notes.txt'}: not a safetensors file"),
             ([str(tmp_path)], f"{tmp_path} is not a fedpar model: {tmp_path} holds neither global.safetensors"),
             ([str(tmp_path / "run"), "--to", str(tmp_path)], f"--to {tmp_path} is a folder"),
             # it wrote a torch file named m.safetensors, which safetensors' load_file refuses (QA)
             ([str(tmp_path / "run"), "--to", str(tmp_path / "m.safetensors")],
              f"fedpar export: --to {tmp_path / 'm.safetensors'}: export writes a torch state_dict file (torch.save), "
              f"not safetensors; name a .pt file, e.g. --to {tmp_path / 'm.pt'} (a run's global.safetensors already "
              "is its model as safetensors: copy that)\n"),
             # it replaced the run's own model with a torch file (QA)
             ([str(tmp_path / "run"), "--to", str(tmp_path / "run" / "global.safetensors")], "is a file of what is "
                                                                                            "exported"),
             ([str(tmp_path / "run" / "global.safetensors"), "--to", str(tmp_path / "run" / "global.safetensors")],
              "is a file of what is exported"),
             # it replaced the run's global.json, the model's description, with a torch file (QA)
             ([str(tmp_path / "run" / "global.safetensors"), "--to", str(tmp_path / "run" / "global.json")],
              f"fedpar export: --to {tmp_path / 'run' / 'global.json'} is a file of what is exported "
              f"({tmp_path / 'run' / 'global.safetensors'}): writing it would replace the model itself; write the "
              f"export elsewhere, e.g. --to {tmp_path / 'run' / 'model.pt'}\n"),
             # it said 'File exists: notes.txt in folder ...' and exited 1 (QA)
             ([str(tmp_path / "run"), "--to", str(tmp_path / "notes.txt" / "sub" / "m.pt")],
              f"--to {tmp_path / 'notes.txt' / 'sub' / 'm.pt'}: {tmp_path / 'notes.txt'} is a file, not a folder; "
              f"write the export into a folder, e.g. --to {tmp_path / 'm.pt'}")]
    for args, line in cases:
        to = [] if "--to" in args else ["--to", str(tmp_path / "m.pt")]
        assert main(["export", *args, *to]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and line in err, err
    assert not (tmp_path / "m.pt").exists()
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "m.pt")]) == 0  # the model is still there
    with pytest.raises(SystemExit):  # --to is required
        main(["export", str(tmp_path / "run")])


def test_export_writes_through_a_link_and_refuses_a_pipe_it_would_replace(tmp_path, capsys):
    _kept_model(tmp_path / "run")
    (tmp_path / "link.pt").symlink_to(tmp_path / "real.pt")
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "link.pt")]) == 0
    assert (tmp_path / "link.pt").is_symlink() and len(torch.load(tmp_path / "real.pt", weights_only=True)) == 8
    os.mkfifo(tmp_path / "pipe")
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "pipe")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a device, a pipe or a socket is there, not a file to replace: pipe in folder" \
        in err, err
    assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)  # still the pipe


def test_export_under_a_file_is_refused_in_one_line_by_the_command(tmp_path, capfd):
    """QA: `fedpar export RUN --to FILE/m.pt` said 'File exists: FILE in folder ...' and exited 1."""
    _kept_model(tmp_path / "run")
    (tmp_path / "notes.txt").write_text("kept")
    done = run_main(["export", "run", "--to", "notes.txt/m.pt"], capfd, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == ["fedpar export: --to notes.txt/m.pt: notes.txt is a file, not a folder; write "
                                        "the export into a folder, e.g. --to m.pt"]
    assert (tmp_path / "notes.txt").read_text() == "kept"


def test_export_of_a_task_runs_checkpoints_names_the_whole_model_its_latest_holds(tmp_path, capfd):
    """QA: `fedpar export OUT/checkpoints` of a `train --task` run said 'sharded DCP checkpoints, not one model',
    though each of its checkpoints holds the whole model, and pointed only at global.safetensors, which a run
    stopped before its end never writes."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    trained = run_main(["train", "--task", f"{root}/examples/own_task.py:task", "--task-option",
                        f"csv={root}/examples/table.csv", "--epochs", "2", "--checkpoint-every", "1", "--no-plot",
                        "--out", "run"], capfd, tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    done = run_main(["export", "run/checkpoints", "--to", "m.pt"], capfd, tmp_path)
    whole = "run/checkpoints/epoch-000002/model.safetensors"
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"is a `fedpar train --task` checkpoint directory; export {whole}, its latest, or the run's --out " \
           "folder, run," in done.stderr and "DCP" not in done.stderr, done.stderr
    done = run_main(["export", whole, "--to", "m.pt"], capfd, tmp_path)
    assert done.returncode == 0, done.stderr
    final = torch.load(tmp_path / "m.pt", weights_only=True)
    assert run_main(["export", "run", "--to", "g.pt"], capfd, tmp_path).returncode == 0
    kept = torch.load(tmp_path / "g.pt", weights_only=True)
    assert final.keys() == kept.keys() and all(torch.equal(final[k], kept[k]) for k in kept)  # the run's last model


def test_export_to_a_path_ending_in_a_slash_is_refused_not_written_as_a_file(tmp_path, capfd):
    """QA: `fedpar export RUN --to newdir/` wrote a file called newdir (Path drops the slash)."""
    _kept_model(tmp_path / "run")
    done = run_main(["export", "run", "--to", "newdir/"], capfd, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == ["fedpar export: error: argument --to: newdir/ ends in '/', which names a "
                                        "folder; name the file to write, e.g. newdir/model.pt; see 'fedpar export "
                                        "--help'"], done.stderr
    assert not (tmp_path / "newdir").exists()


def test_export_of_a_folder_holding_a_model_and_a_checkpoint_says_which_it_took_and_its_round(tmp_path, capsys):
    """QA: with --out and --checkpoint-dir one folder, export took its global.safetensors, said only 'from FOLDER',
    and the user could not tell it was not the later round the folder's checkpoint holds."""
    from fedpar.server.checkpoint import Checkpoint, save_checkpoint

    run = tmp_path / "run"
    weights = _kept_model(run)
    names = [n for n, _, _ in weight_specs(build_model_for_data("cnn", (1, 8, 8), 10))]
    later = [w + 1 for w in weights]
    save_checkpoint(run, Checkpoint(5, names, later, {}, {"sampler": {}}))
    kept = run / "round-000005"
    exports = [(run, weights, f"from {run / 'global.safetensors'} (round 3), not the latest checkpoint beside it, "
                              f"{kept} (round 5): export {kept} for that one"),
               (kept, later, f"from {kept / 'global.safetensors'} (round 5)\n")]
    for source, arrays, said in exports:
        assert main(["export", str(source), "--to", str(tmp_path / "m.pt")]) == 0
        assert said in capsys.readouterr().out
        exported = torch.load(tmp_path / "m.pt", weights_only=True)
        assert all(np.array_equal(t.numpy(), a) for t, a in zip(exported.values(), arrays))
    (run / "global.safetensors").unlink()
    assert main(["export", str(run), "--to", str(tmp_path / "m.pt")]) == 0
    assert f"from {kept} (round 5), its latest checkpoint\n" in capsys.readouterr().out
    _kept_model(tmp_path / "same")
    save_checkpoint(tmp_path / "same", Checkpoint(3, names, weights, {}, {"sampler": {}}))
    assert main(["export", str(tmp_path / "same"), "--to", str(tmp_path / "m.pt")]) == 0
    assert f"(round 3), the same round as the latest checkpoint beside it, {tmp_path / 'same' / 'round-000003'}\n" \
        in capsys.readouterr().out


def test_export_of_the_out_folder_of_a_run_still_running_says_so(tmp_path, capfd):
    """QA: `fedpar export OUT` while a run into OUT was still going exported the model an earlier run had left there
    (or said OUT held no model), with no word that the run had not ended."""
    from fedpar.cli.user_errors import OUTPUT_LOCK
    from fedpar.protocol.file_lock import hold
    from support.in_process import run_main

    _kept_model(tmp_path / "run")
    lock = hold(tmp_path / "run" / OUTPUT_LOCK)  # as `fedpar simulate --out run` holds it while it runs
    try:
        for source in ("run", "run/global.safetensors"):
            done = run_main(["export", source, "--to", "m.pt"], capfd, cwd=tmp_path)
            assert done.returncode == 2 and done.stdout == "" and done.stderr == (
                f"fedpar export: run is the --out folder of a run still running (pid {os.getpid()}): it writes its "
                "global.safetensors as it ends, and the one there now is an earlier run's; wait for it to end, or "
                "export its --checkpoint-dir for its latest round\n"), done.stderr
    finally:
        lock.release(remove=True)
    assert not (tmp_path / "m.pt").exists()
    assert run_main(["export", "run", "--to", "m.pt"], capfd, cwd=tmp_path).returncode == 0  # the run has ended


def test_export_into_a_folder_that_cannot_be_written_is_refused_before_the_model_is_read(tmp_path, capfd):
    """QA: `fedpar export RUN --to /sys/m.pt` said 'Permission denied: m.pt in folder /sys; check the permissions, or
    pick another path (--debug shows the traceback)' and exited 1, once it had read the model."""
    from support.in_process import run_main

    _kept_model(tmp_path / "run")
    for to, line in (("/proc/m.pt", "--to /proc: cannot write in the folder: No such file or directory; give a folder "
                                    "this user can write"),
                     ("/proc/x/m.pt", "--to /proc/x: cannot make the folder: No such file or directory; give a folder "
                                      "this user can make, or one that exists")):
        done = run_main(["export", "run", "--to", to], capfd, cwd=tmp_path)
        assert done.returncode == 2 and done.stdout == "" and done.stderr == f"fedpar export: {line}\n", done.stderr


def test_export_of_the_out_folder_of_a_one_shot_serve_still_running_says_so(tmp_path, capfd):
    """QA: a one-shot `fedpar serve --out so` held no lock on --out, so `fedpar export so` while it ran said 'so holds
    neither global.safetensors ... nor LATEST' (or, beside a resumed run, exported the model an earlier run had left
    there) with no word that the run had not ended; serve now holds --out as simulate and train do."""
    import re

    fedpar = [sys.executable, "-m", "fedpar"]
    serve = subprocess.Popen(fedpar + ["serve", "--insecure", "--host", "127.0.0.1", "--port", "0", "--rounds", "1",
                                       "--accept-populations", "--min-available", "4", "--out", "so"],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:  # listening: --out is held by then (no agent joins, so its one round never starts)
        assert re.search(r"listening on 127\.0\.0\.1:\d+", serve.stdout.readline())
        # the export and the second serve by their mains in this process: the running serve is the other process
        done = run_main(["export", "so", "--to", "m.pt"], capfd, tmp_path)
        again = run_main(["serve", "--insecure", "--host", "127.0.0.1", "--port", "0", "--rounds", "1",
                          "--min-available", "4", "--out", "so"], capfd, tmp_path)
    finally:
        serve.kill()
        serve.wait(timeout=30)
    assert done.returncode == 2 and done.stderr == (
        f"fedpar export: so is the --out folder of a run still running (pid {serve.pid}): it writes its "
        "global.safetensors as it ends, and there is none yet; wait for it to end, or export its --checkpoint-dir for "
        "its latest round\n"), done.stderr
    assert not (tmp_path / "m.pt").exists()
    lines = [line for line in again.stderr.splitlines() if "fedpar.security" not in line]
    assert again.returncode == 2 and lines == [
        f"fedpar serve: --out so is in use by another fedpar run (pid {serve.pid}); wait for it to end, or give "
        "another --out"], again.stderr


def test_export_of_a_damaged_checkpoint_says_what_is_damaged_and_what_to_export_not_how_to_resume(tmp_path, capfd):
    """QA: `fedpar export CK` of a checkpoint directory whose latest round is damaged advised 'to resume from the
    previous checkpoint instead, write 'round-000002' into CK/LATEST (the rounds after it run again)': a resume's
    advice; export resumes nothing (and 'delete the checkpoint directory' would lose the older rounds)."""
    done = run_main(["simulate", "--clients", "4", "--rounds", "3", "--local-epochs", "1", "--quiet",
                     "--checkpoint-dir", "ck", "--out", "o"], capfd, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    os.truncate(tmp_path / "ck" / "round-000003" / "global.safetensors", 100)  # a write cut short
    done = run_main(["export", "ck", "--to", "m.pt"], capfd, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "" and done.stderr == (
        "fedpar export: cannot export the latest checkpoint in ck: damaged checkpoint: "
        "ck/round-000003/global.safetensors: not a safetensors file, or a truncated or damaged one (Error while "
        "deserializing header: invalid header length); export an earlier round instead, ck/round-000002, or the "
        "run's --out folder (its global.safetensors, written as the run ended)\n"), done.stderr
    assert run_main(["export", "ck/round-000002", "--to", "m.pt"], capfd, cwd=tmp_path).returncode == 0
    (tmp_path / "ck" / "LATEST").write_text("round-000001\n")  # pruned: no round but the damaged one is left
    done = run_main(["export", "ck", "--to", "m2.pt"], capfd, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.endswith(
        "ck/LATEST names 'round-000001', which is not a checkpoint directory in ck; export an earlier round instead, "
        "ck/round-000003, or the run's --out folder (its global.safetensors, written as the run ended)\n"), done.stderr


def test_export_of_the_out_folder_of_a_stopped_task_run_names_its_latest_checkpoints_model(tmp_path, capfd):
    """QA: `fedpar export OUT` of a `train --task` run stopped with Ctrl-C (which writes no global.safetensors) said
    'OUT holds neither global.safetensors (a run's --out folder) nor LATEST (a coordinator checkpoint directory)',
    though OUT is a run's --out folder and its latest checkpoint holds the whole model."""
    import signal
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    fedpar = [sys.executable, "-m", "fedpar"]
    run = subprocess.Popen([*fedpar, "train", "--task", f"{root}/examples/own_task.py:task", "--task-option",
                            f"csv={root}/examples/table.csv", "--epochs", "100000", "--checkpoint-every", "1",
                            "--no-plot", "--out", "run"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    try:
        deadline = time.monotonic() + 120
        while not latest.is_file():  # a checkpoint kept: the run is stopped after it
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.01)
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130 and not (tmp_path / "run" / "global.safetensors").exists()
    whole = f"run/checkpoints/{latest.read_text().strip()}/model.safetensors"
    done = run_main(["export", "run", "--to", "m.pt"], capfd, tmp_path)
    assert done.returncode == 2 and done.stderr == (
        "fedpar export: run is not a fedpar model: run is the --out folder of a `fedpar train` run that has not ended "
        f"(it writes its global.safetensors as it ends): the same command resumes it; export {whole}, its latest "
        "checkpoint's model\n"), done.stderr
    assert run_main(["export", whole, "--to", "m.pt"], capfd, tmp_path).returncode == 0
