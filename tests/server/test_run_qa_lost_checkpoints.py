"""`fedpar serve --state` started again after a run's outputs folder (its checkpoints) was moved or deleted while the
service was stopped: the run that was running fails saying its checkpoints are gone and where to put them back (it is
tried again at the next start), rather than starting afresh from the initial model while its log says it resumed. A
real `fedpar serve --state` process over a run store left as a stopped service leaves it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from fedpar.security.certs import ensure_certs
from fedpar.server.run_store import RunStore
from support.processes import stop_processes

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_whose_checkpoints_are_gone_fails_to_resume_and_is_not_trained_afresh(tmp_path):
    certs, state = tmp_path / "certs", tmp_path / "state.db"
    ensure_certs(certs, operators=["op"])
    store = RunStore(state)  # what a service stopped after round 3 of run 1 left, less the run's folder
    run_id = store.submit("long", {"rounds": 100}, who="op")
    out = Path(f"{state}.runs") / str(run_id)
    store.start(run_id, str(out))
    for round_id in (1, 2, 3):
        store.record_round(run_id, {"round": round_id, "status": "ok"})
    store.close()
    with open(tmp_path / "serve.log", "w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", "serve", "--state", str(state), "--certs",
                                  str(certs), "--port", "0", "--control-port", "0"], cwd=ROOT, stdout=log,
                                 stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    store = RunStore(state)
    try:
        # before: it 'resumed' at round 0, waiting for agents to train its rounds again from the initial model
        end = time.monotonic() + 60
        while store.get(run_id).status != "failed" and time.monotonic() < end and serve.poll() is None:
            if any("waits for" in line for kind, _, line in store.timeline(run_id) if kind == "line"):
                break
            time.sleep(0.2)
        run = store.get(run_id)
        assert run.status == "failed", ((tmp_path / "serve.log").read_text(), store.timeline(run_id))
        assert run.reason == (
            f"cannot resume: its checkpoints {out / 'checkpoints'} are gone (moved or deleted since its round 3): "
            "put them back where they were (starting it afresh would train its rounds again from the initial "
            "model); the service tries again when it is started again on the same --state"), run.reason
        assert run.round == 3 and [r["round"] for r in store.round_metrics(run_id)] == [1, 2, 3]  # kept as they were
        assert serve.poll() is None  # the service goes on with the next run
    finally:
        stop_processes(serve)
        store.close()
    said = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in said and f"run {run_id} (long) failed: cannot resume: its checkpoints" in said, said
