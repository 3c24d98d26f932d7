"""A stop signal that comes while `fedpar train` keeps or resumes a checkpoint stops it as one between steps does: one
line, exit 128 + the signal's number, ``latest`` on the last complete checkpoint (QA: 1 run in 3 ended in a traceback,
``ValueError: 'SIGINT' is not a valid Signals``, exit 1)."""

from __future__ import annotations

import copy
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from fedpar.parallel.checkpoint import check_checkpoint, latest_checkpoint
from fedpar.parallel.init import LaunchStopped
from fedpar.parallel.stopping import StopRequested
from support.in_process import run_main

FEDPAR = [sys.executable, "-m", "fedpar"]


@pytest.mark.parametrize("rebuild", [pickle.loads, copy.copy, copy.deepcopy], ids=["pickle", "copy", "deepcopy"])
@pytest.mark.parametrize("stop", [StopRequested(signal.SIGINT), LaunchStopped(signal.SIGTERM, True)],
                         ids=["StopRequested", "LaunchStopped"])
def test_a_stop_is_rebuilt_as_itself(stop, rebuild):
    # DCP pickles what a step of its save raised to gather it from every rank: rebuilt from its args, the signal's
    # name, as a signal number, it was a ValueError
    stop.kept_step = 3
    again = rebuild(pickle.dumps(stop) if rebuild is pickle.loads else stop)
    assert type(again) is type(stop) and again.args == stop.args and again.__dict__ == stop.__dict__


# One process in a one-rank gloo group (as `fedpar train` on one process), for each WHERE:SIGNAL of its argv in turn: a
# checkpoint at step 1, then the signal raised from within DCP, at the step named by WHERE; a line for each
INSIDE_DCP = """
import signal, sys, tempfile
from pathlib import Path
import torch, torch.distributed as dist
from fedpar.parallel.dcp_storage import PlainFileSystemReader, PlainFileSystemWriter
from fedpar.parallel.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fedpar.parallel.stopping import StopRequested, stop_on_signals

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for case in sys.argv[1:]:
    where, signame = case.split(":")
    signum = signal.Signals[signame]
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    folder = Path(tempfile.mkdtemp())
    save_checkpoint(folder, [model], [optimizer], {"step": 1})
    kind, name = {"write": (PlainFileSystemWriter, "write_data"), "metadata": (PlainFileSystemWriter, "finish"),
                  "load": (PlainFileSystemReader, "read_data"),
                  "swallowed": (PlainFileSystemWriter, "write_data")}[where]
    original = getattr(kind, name)

    def stopped(self, *args, **kwargs):
        if where == "swallowed":  # raised in a write C++ code calls back, it comes out as that code's error
            try:
                signal.raise_signal(signum)
            except KeyboardInterrupt:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
        signal.raise_signal(signum)  # its handler runs as this returns, inside DCP
        return original(self, *args, **kwargs)

    setattr(kind, name, stopped)
    try:
        with stop_on_signals():
            if where == "load":
                load_checkpoint(folder / "step-00000001", [model], [optimizer])
            else:
                save_checkpoint(folder, [model], [optimizer], {"step": 2})
        print(case, "went on", flush=True)
    except StopRequested as stop:
        print(case, "stopped by", signal.Signals(stop.signum).name, "latest", latest_checkpoint(folder).name,
              flush=True)
    finally:
        setattr(kind, name, original)
"""
DCP_STOPS = {"writing-shards": "write:SIGINT", "writing-metadata": "metadata:SIGTERM", "loading": "load:SIGINT",
             "swallowed-by-c-code": "swallowed:SIGTERM"}


@pytest.fixture(scope="module")
def stopped_inside_dcp() -> tuple[dict[str, str], str]:
    """Each case of DCP_STOPS run by INSIDE_DCP in one process (a start of torch.distributed each cost seconds): its
    line by case, and what the process wrote to stderr."""
    done = subprocess.run([sys.executable, "-c", INSIDE_DCP, *DCP_STOPS.values()], capture_output=True, text=True,
                          timeout=120)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    return lines, done.stderr


@pytest.mark.parametrize("case", list(DCP_STOPS))
def test_a_stop_inside_dcp_is_raised_as_itself_and_latest_stays_on_the_complete_checkpoint(case, stopped_inside_dcp):
    """A stop signal raised inside DCP's write, metadata, load, or a write C code (torch's, gloo's) swallows: the stop
    itself comes out, and ``latest`` stays on the complete checkpoint."""
    # DCP catches what each step raises (BaseException) and gathers it from every rank: a stop came out as a
    # CheckpointException (on load: "checkpoint could not be read", exit 2), when its pickling did not fail first
    lines, err = stopped_inside_dcp
    signame = DCP_STOPS[case].split(":")[1]
    assert lines.get(DCP_STOPS[case]) == f"stopped by {signame} latest step-00000001", (lines, err)


def test_train_stopped_as_it_keeps_a_checkpoint_every_step_stops_in_one_line_and_resumes(tmp_path):
    # each run resumes the last; the signal comes as `latest` moves on, and a step with its checkpoint takes a few
    # milliseconds, so it lands within a checkpoint's save in most runs and between the steps in the others
    out = tmp_path / "out"
    latest = out / "checkpoints" / "latest"
    for signum, delay in [(signal.SIGINT, 0.0), (signal.SIGINT, 0.005), (signal.SIGTERM, 0.01), (signal.SIGINT, 0.02)]:
        before = latest.read_text() if latest.is_file() else None
        run = subprocess.Popen([*FEDPAR, "train", "--dataset", "digits", "--max-steps", "100000", "--log-every",
                                "100000", "--checkpoint-every", "1", "--batch-size", "1", "--device", "cpu",
                                "--no-plot", "--out", str(out)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + 120
            while not latest.is_file() or latest.read_text() == before:
                assert run.poll() is None and time.monotonic() < deadline, run.communicate()
                time.sleep(0.002)
            time.sleep(delay)
            run.send_signal(signum)
            _, err = run.communicate(timeout=60)
        finally:
            run.kill()
        kept = latest_checkpoint(out / "checkpoints")
        check_checkpoint(kept)
        assert run.returncode == 128 + signum and len(err.strip().splitlines()) == 1, err
        assert err.strip().endswith(f"; the same command resumes from its checkpoint {kept.name}"), err


# Installed in every process of `fedpar train` (a sitecustomize.py on PYTHONPATH, so spawned ranks have it as forked
# ones do): its ranks, as they write their first checkpoint, send the launcher a Ctrl-C and wait in DCP's write for the
# launcher to stop them.
STOPPED_IN_FIRST_SAVE = """
import os, signal, time
from fedpar.parallel.dcp_storage import PlainFileSystemWriter

original = PlainFileSystemWriter.write_data

def stopped(self, *args, **kwargs):
    os.kill(os.getppid(), signal.SIGINT)
    time.sleep(60)
    return original(self, *args, **kwargs)

PlainFileSystemWriter.write_data = stopped
"""


def test_a_fresh_run_stopped_in_its_first_checkpoint_leaves_the_earlier_runs_checkpoint_whole_and_resumable(
        tmp_path, capfd):
    """QA: `fedpar train --no-resume --nproc 2` over an earlier run whose `latest` named step-00000001, stopped as it
    wrote its own step-00000001, had removed the earlier one first and written into its folder; having written
    nothing else, it put the earlier `latest` back, naming an empty folder: 'latest names step-00000001, which holds no
    complete checkpoint' (exit 2). A checkpoint is now written whole under another name and takes the name after."""
    train = ["train", "--dataset", "digits", "--checkpoint-every", "1", "--device", "cpu", "--no-plot", "--out", "r"]
    # the earlier run and the resume by fedpar's main in this process; the stopped run is a process of its own
    assert run_main([*train, "--max-steps", "1"], capfd, tmp_path).returncode == 0
    step = tmp_path / "r" / "checkpoints" / "step-00000001"
    kept = {p.name: p.read_bytes() for p in step.iterdir()}
    patched = tmp_path / "patched"
    patched.mkdir()
    (patched / "sitecustomize.py").write_text(STOPPED_IN_FIRST_SAVE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(patched), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "fedpar", *train, "--max-steps", "5", "--no-resume", "--nproc", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 130 and done.stderr == (
        "fedpar train: interrupted after 0 logged steps; wrote nothing to r; the same command without --no-resume "
        "resumes from its checkpoint step-00000001\n"), done.stderr
    assert latest_checkpoint(tmp_path / "r" / "checkpoints") == step
    assert {p.name: p.read_bytes() for p in step.iterdir()} == kept  # the earlier run's, as it was
    again = run_main([*train, "--max-steps", "3"], capfd, tmp_path)
    assert again.returncode == 0 and "resumed from" in again.stdout + again.stderr, again.stderr
    assert not list(step.parent.glob("*.partial"))  # what the stopped save left goes once a checkpoint is complete
