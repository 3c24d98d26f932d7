"""`fedpar train` meets a damaged checkpoint, a Ctrl-C of its ranks and a reader that left its pipe: one line (or
none), a non-zero exit, no traceback from any process, and a run that resumes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpar.cli.main import main
from support.in_process import run_main

pytestmark = pytest.mark.timeout(300)
LAUNCHED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def _train(out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "mlp", "--dataset", "digits", "--device", "cpu", "--checkpoint-every", "2",
            "--no-plot", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """A one-rank run of 4 steps, checkpointed after steps 2 and 4."""
    out = tmp_path_factory.mktemp("ck") / "run"
    with pytest.MonkeyPatch.context() as mp:
        for name in LAUNCHED:
            mp.delenv(name, raising=False)
        assert main(_train(out, "--max-steps", "4")) == 0
    return out


def _in_dcps_own_format(checkpoint: Path) -> None:
    """Its metadata as DCP's own file storage writes it (pickled), as fedpar's checkpoints were before 2026-11-29."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(1)}, checkpoint_id=str(checkpoint.with_name("dcp-own")), no_dist=True)
    shutil.copy(checkpoint.with_name("dcp-own") / ".metadata", checkpoint / ".metadata")


def _overwrite_start(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:200] = b"x" * 200  # same size: only reading it finds the damage
    path.write_bytes(bytes(data))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP's own save, on one process
@pytest.mark.parametrize("damage, said", [
    (lambda ck: os.truncate(ck / "__0_0.distcp", 100), "its file __0_0.distcp has 100 bytes, its metadata says"),
    (lambda ck: (ck / "__0_0.distcp").unlink(), "its file __0_0.distcp is missing"),
    (lambda ck: os.truncate(ck / ".metadata", 50), "checkpoint metadata is damaged"),
    (lambda ck: (ck.parent / "latest").write_text("step-00000003\n"), "names step-00000003, which holds no complete"),
    (lambda ck: _overwrite_start(ck / "__0_0.distcp"), "does not hold the bytes its metadata says for"),
    (_in_dcps_own_format, "its metadata is pickled (torch's own format, as fedpar wrote checkpoints before"),
])
def test_a_damaged_checkpoint_is_one_line_naming_the_one_before_it(two_checkpoints, tmp_path, monkeypatch, capsys,
                                                                   damage, said):
    for name in LAUNCHED:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    damage(out / "checkpoints" / "step-00000004")
    capsys.readouterr()
    code = main(_train(out, "--max-steps", "6"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert (code, len(lines)) == (2, 1), lines
    assert lines[0].startswith("fedpar train: ") and said in lines[0], lines
    assert lines[0].endswith(f"write step-00000002 into {out / 'checkpoints' / 'latest'} to resume the one before "
                             "it, or pass --no-resume to start afresh (or another --out)"), lines
    assert json.loads((out / "summary.json").read_text())["steps"] == 4  # nothing trained, nothing overwritten
    (out / "checkpoints" / "latest").write_text("step-00000002\n")  # as the line says
    assert main(_train(out, "--max-steps", "6")) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2


def _launch(out: Path, *extra: str, **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHED}
    return subprocess.Popen([sys.executable, "-m", "fedpar", *_train(out, "--nproc", "2", "--log-every", "1",
                                                                     *extra)],
                            env=env, stderr=subprocess.PIPE, text=True, start_new_session=True, **popen)


def _left_behind(pid: int, wait: float = 5.0) -> list[int]:
    """The processes of the session ``pid`` led (its launcher's ranks, multiprocessing's helper) still there after
    ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.getsid(int(entry.name)) == pid:
                    found.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_ctrl_c_stops_both_ranks_with_one_line_130_and_the_run_resumes(tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    proc = _launch(out, "--epochs", "500", stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and \
                not (out / "checkpoints" / "latest").exists():
            time.sleep(0.05)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the terminal's whole process group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, err[-3000:]
    assert _left_behind(proc.pid) == []  # no rank left behind
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert lines[0].startswith("fedpar train: interrupted after ") and \
        lines[0].endswith(f"/metrics.jsonl, metrics.csv and summary.json; the same command resumes from its checkpoint "
                          f"{latest}"), lines
    step = int(latest.split("-")[1])
    for name in LAUNCHED:
        monkeypatch.delenv(name, raising=False)
    # the same run, 2 steps more: its main in this process (its two ranks are processes all the same)
    done = run_main(_train(out, "--nproc", "2", "--log-every", "1", "--max-steps", str(step + 2)), capfd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at step {step}" in done.stdout and json.loads((out / "summary.json").read_text())["steps"] == step + 2


def test_a_reader_that_leaves_the_pipe_ends_two_ranks_quietly_with_141(tmp_path):
    proc = _launch(tmp_path / "run", "--max-steps", "2000", stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()  # the first line, as '| head -1' reads it
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, err) == (141, ""), err[-3000:]
    assert _left_behind(proc.pid) == []


@pytest.mark.parametrize("degrees, ranks", [(["--fsdp", "2"], 2), (["--nproc", "3", "--tp", "2"], 2)])
def test_degrees_the_ranks_do_not_divide_say_how_many_ranks_to_ask_for(tmp_path, degrees, ranks, monkeypatch,
                                                                        capfd):
    """It said only 'choose degrees whose product divides 1' (QA, following the centralized-training guide without
    --nproc): the way out is asking for more ranks."""
    for name in LAUNCHED:
        monkeypatch.delenv(name, raising=False)
    done = run_main(_train(tmp_path / "run", *degrees), capfd)  # its main in this process: refused before any rank
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"ask for a multiple of {ranks} ranks (e.g. --nproc {ranks}, or torchrun's world size)" in lines[0], lines
    assert not (tmp_path / "run").exists()  # refused before any rank started or wrote
