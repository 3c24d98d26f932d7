"""A run that failed with "cannot resume" (its checkpoints gone) is tried again at every start of the service; an
operator who gives it up stops it with `fedpar run stop ID`: one line, exit 0, and it stays stopped, never tried
again. A real `fedpar serve --state` process, started twice on the same state file, over a run store left as a
stopped service leaves it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from fedpar.security.certs import ensure_certs
from fedpar.server.run_store import RunStore
from support.in_process import main_here
from support.processes import stop_processes

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _serve(tmp_path: Path, state: Path, certs: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """A service on ``state``, started; its control address."""
    port_file = tmp_path / "cport"
    port_file.unlink(missing_ok=True)
    with open(log, "w") as out:
        serve = subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", "serve", "--state", str(state), "--certs",
                                  str(certs), "--port", "0", "--control-port", "0", "--control-port-file",
                                  str(port_file)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=ENV)
    end = time.monotonic() + 60
    while not port_file.exists() and serve.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
    assert serve.poll() is None and port_file.exists(), log.read_text()
    return serve, f"127.0.0.1:{int(port_file.read_text())}"


def test_a_run_that_cannot_resume_can_be_stopped_and_is_not_tried_again(tmp_path):
    certs, state = tmp_path / "certs", tmp_path / "state.db"
    ensure_certs(certs, operators=["op"])
    store = RunStore(state)  # a service stopped after round 2 of run 1, whose outputs were deleted since
    run_id = store.submit("lost", {"rounds": 100}, who="op")
    store.start(run_id, str(Path(f"{state}.runs") / str(run_id)))
    for round_id in (1, 2):
        store.record_round(run_id, {"round": round_id, "status": "ok"})
    other = store.submit("broken", {"rounds": 1}, who="op")  # failed for another reason: nothing to stop
    store.end(other, "failed", "every round failed (1 of 1)")
    store.close()
    serve, control = _serve(tmp_path, state, certs, tmp_path / "serve1.log")
    store = RunStore(state)
    try:
        end = time.monotonic() + 60
        while store.get(run_id).status != "failed" and time.monotonic() < end:
            time.sleep(0.2)
        assert store.get(run_id).reason.startswith("cannot resume: its checkpoints"), store.get(run_id)
        options = ("--control", control, "--certs", str(certs), "--operator", "op")
        # before: 'fedpar run: run 1 already ended (failed): nothing to stop', exit 1, and tried again at each start
        done = main_here("run", "stop", str(run_id), *options)
        assert (done.returncode, done.stderr) == (0, ""), done
        assert done.stdout.splitlines() == [f"run {run_id} had failed (it could not resume): stopped, so the service "
                                            "no longer tries it again when it starts"], done.stdout
        run = store.get(run_id)
        assert run.status == "stopped" and run.reason.startswith(
            "stopped by op after it could not resume: its checkpoints"), run
        assert "tries again" not in run.reason, run.reason
        done = main_here("run", "stop", str(other), *options)
        assert done.returncode == 1 and done.stderr == (f"fedpar run: run {other} already ended (failed): nothing to "
                                                        "stop\n"), done
        assert store.get(other).status == "failed"
    finally:
        stop_processes(serve)
    serve, control = _serve(tmp_path, state, certs, tmp_path / "serve2.log")  # started again: not tried again
    try:
        time.sleep(1.0)  # a run queued again at the start is picked up within IDLE_POLL_SECONDS
        assert store.get(run_id).status == "stopped", store.get(run_id)
    finally:
        stop_processes(serve)
        store.close()
    said = (tmp_path / "serve2.log").read_text()
    assert "Traceback" not in said and f"run {run_id} could not resume" not in said, said
