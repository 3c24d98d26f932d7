"""QA: a run stopped with `fedpar run stop ID` while its last finished round's row was still being written (its
central evaluation, checkpoint and metrics row run after the next round's tasks went out) was listed at ROUND N+1
beside 'stopped after round N' when that write took longer than server.stop's 0.5 s grace: the reason was read
before the row landed. A run stop now waits for that write (server/app.py stop(settle=True)), so the reason, the round
`fedpar run ls` shows, the last row, the summary and the model name one round. The slow write is forced: once the run
has recorded two rounds, the run's task (a module of this test's) takes 2 s for a central evaluation in the service's
process and notes when one starts and ends; the stop comes while one runs. A real `fedpar serve --state` process and
two real `fedpar client` agents on 127.0.0.1 (ports 0)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpar.security.certs import ensure_certs
from fedpar.server.run_store import RunStore
from support.in_process import main_here
from support.processes import stop_processes
from support.stopped_runs import assert_stopped_as_recorded

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
SLOW_SECONDS = 2.0  # the slowed central evaluation in the service: four times the stop's 0.5 s grace
# every other evaluation in the service takes this long: more than server/coordinator.py LOOP_EVALUATION_SECONDS, so
# that all of them, the slowed one too, run on a worker thread while the loop answers the stop
QUICK_SECONDS = 0.02
TASK = f'''"""The zoo's mlp on digits, whose central evaluation (where SLOW_EVAL_DIR is set: the service's process)
takes {QUICK_SECONDS} s more, or, once that folder holds 'slow', notes its start and end there around {SLOW_SECONDS} s
more."""
import os
import time
from pathlib import Path

from fedpar.tasks.evaluation import builtin_evaluation
from fedpar.tasks.zoo import classifier


def task():
    made = classifier("mlp", "digits")

    def evaluate(model, dataset):
        folder = os.environ.get("SLOW_EVAL_DIR")
        if folder and (Path(folder) / "slow").exists():
            mark = str(time.monotonic_ns())
            (Path(folder) / f"{{mark}}.started").touch()
            time.sleep({SLOW_SECONDS})
            (Path(folder) / f"{{mark}}.ended").touch()
        elif folder:
            time.sleep({QUICK_SECONDS})
        return builtin_evaluation(made, model, dataset)

    made.evaluate = evaluate
    return made
'''
RUN = ('task = "slow_eval_task:task"\nrounds = 100000\nclients_per_round = 2\nmin_reports = 1\nlocal_epochs = 1\n'
       'batch_size = 256\n')


def _wait_for(predicate, timeout: float, what) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, what() if callable(what) else what
        time.sleep(0.05)


def _fedpar(log: Path, env: dict, *args: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def test_a_run_stopped_while_its_last_row_is_slowly_written_names_that_row_s_round(tmp_path):
    (tmp_path / "slow_eval_task.py").write_text(TASK)
    marks = tmp_path / "evaluations"
    marks.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    certs, state = tmp_path / "certs", tmp_path / "state.db"
    ensure_certs(certs, ["a1", "a2"], ["127.0.0.1"], operators=["op"])
    serve = _fedpar(tmp_path / "serve.log", {**env, "SLOW_EVAL_DIR": str(marks)}, "serve", "--state", str(state),
                    "--certs", str(certs), "--port", "0", "--control-port", "0", "--port-file",
                    str(tmp_path / "port"), "--control-port-file", str(tmp_path / "cport"), "--min-available", "2",
                    "--heartbeat", "1")
    agents: list[subprocess.Popen] = []
    store = None
    log = lambda: (tmp_path / "serve.log").read_text()[-3000:]  # noqa: E731
    try:
        _wait_for(lambda: (tmp_path / "cport").exists() or serve.poll() is not None, 60, "serve did not start")
        assert serve.poll() is None, log()
        port = int((tmp_path / "port").read_text())
        agents = [_fedpar(tmp_path / f"a{i}.log", env, "client", "--server", f"127.0.0.1:{port}", "--certs",
                          str(certs), "--agent-id", f"a{i}", "--task", "slow_eval_task:task", "--num-partitions", "8",
                          "--partition-index", str(i), "--poll", "1", "--threads", "1", "--max-backoff", "0.5")
                  for i in (1, 2)]
        store = RunStore(state)
        options = ("--control", f"127.0.0.1:{int((tmp_path / 'cport').read_text())}", "--certs", str(certs),
                   "--operator", "op")
        (tmp_path / "run.toml").write_text(RUN)
        done = main_here("run", "submit", str(tmp_path / "run.toml"), *options)
        assert done.returncode == 0, done
        run_id = int(done.stdout)
        _wait_for(lambda: store.get(run_id).round >= 2, 180, log)  # two rows written, each evaluated on a thread
        (marks / "slow").touch()
        _wait_for(lambda: any(marks.glob("*.started")), 60, log)  # a later round's evaluation has started, slowly
        assert main_here("run", "stop", str(run_id), *options).returncode == 0
        _wait_for(lambda: store.get(run_id).status == "stopped", 60, lambda: store.get(run_id))
        # a row still being written when the run ended lands meanwhile: its evaluation ends, then its checkpoint
        _wait_for(lambda: len(list(marks.glob("*.ended"))) == len(list(marks.glob("*.started"))), 60, log)
        time.sleep(1.0)
        assert_stopped_as_recorded(store, run_id)  # before: ROUND N + 1, the row of the round evaluated at the stop
        assert "test_loss" in store.round_metrics(run_id)[-1]  # the slow evaluation's row itself was kept
    finally:
        if store is not None:
            store.close()
        stop_processes(*agents, serve)
    assert "Traceback" not in log(), log()
