"""A simulation host (`fedpar simulate-workers` under torchrun) in a long-lived service (`fedpar serve --state
--accept-populations`): it dials under its own certificate from the service's CA, and its members take part in one run
after another without the host leaving (a host was told "training finished" at the end of the first run, and its
kept streams stayed bound to the coordinator of the moment: the next run's tasks never reached it). Real processes
on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from fedpar.security.certs import ensure_certs
from fedpar.server.run_store import RunStore
from support.in_process import run_main
from support.processes import stop_processes

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
MEMBERS = 20
RUN = 'clients_per_round = 4\nmin_reports = 4\nlocal_epochs = 1\nbatch_size = 32\nlearning_rate = 1e-9\n'
# The first run ends at round 1 and the second starts there: the host must not train the second's round 1 from the
# first's model (another seed: other initial weights), which it kept. With a learning rate of ~0, a run's final
# model is its initial one.
RUNS = [RUN + 'rounds = 1\nseed = 1\n', RUN + 'rounds = 2\nseed = 2\n']


def _fedpar(tmp: Path, name: str, *args: str, torchrun: bool = False) -> subprocess.Popen:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "fedpar"] if torchrun \
        else ["-m", "fedpar"]
    return subprocess.Popen([sys.executable, *launcher, *args], cwd=ROOT, env=ENV, stdout=open(tmp / f"{name}.log", "w"),
                            stderr=subprocess.STDOUT)


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, what
        time.sleep(0.1)


def test_a_simulation_host_under_mutual_tls_stays_joined_for_one_run_after_another(tmp_path, capfd):
    certs = tmp_path / "certs"
    ensure_certs(certs, ["host-0-of-1"], ["127.0.0.1"], operators=["op"])
    serve = _fedpar(tmp_path, "serve", "serve", "--state", str(tmp_path / "state.db"), "--certs", str(certs),
                    "--accept-populations", "--min-available", str(MEMBERS), "--port", "0", "--port-file",
                    str(tmp_path / "port"), "--control-port", "0", "--control-port-file", str(tmp_path / "cport"),
                    "--heartbeat", "1")
    host = None
    try:
        _wait_for(lambda: (tmp_path / "cport").exists() or serve.poll() is not None, 60, "serve did not start")
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()
        port, control = (int((tmp_path / name).read_text()) for name in ("port", "cport"))
        host = _fedpar(tmp_path, "host", "simulate-workers", "--server", f"127.0.0.1:{port}", "--certs", str(certs),
                       "--clients", str(MEMBERS), "--dataset", "digits", "--seats", "2", "--max-backoff", "0.5",
                       torchrun=True)
        store = RunStore(tmp_path / "state.db")
        runs = []
        for settings in RUNS:  # submitted one after the other: the second starts after the first has ended
            (tmp_path / "run.toml").write_text(settings)
            done = run_main(["run", "submit", str(tmp_path / "run.toml"), "--control", f"127.0.0.1:{control}",
                             "--certs", str(certs), "--operator", "op"], capfd, ROOT)  # its main, in this process
            assert done.returncode == 0, done.stderr
            runs.append(int(done.stdout.strip()))
            _wait_for(lambda: store.get(runs[-1]).status in ("finished", "failed", "stopped"), 120,
                      f"run {runs[-1]} did not end: " + (tmp_path / "serve.log").read_text()[-2000:])
        for run_id, rounds in zip(runs, (1, 2)):
            assert store.get(run_id).status == "finished", store.get(run_id).reason
            rows = store.round_metrics(run_id)
            assert [(r["round"], r["status"], r["reported"]) for r in rows] == [(i, "ok", 4) for i in
                                                                                range(1, rounds + 1)], rows
            assert all(r["round_seconds"] < 20 for r in rows), rows  # no round waited out a deadline
        first, second = (load_file(store.get(run_id).model_path) for run_id in runs)
        assert max(float(np.abs(first[k] - second[k]).max()) for k in first) > 1e-3  # not the first run's model
        log = (tmp_path / "host.log").read_text()  # before the host is stopped (torchrun prints its own traceback)
        assert host.poll() is None, log  # still joined, for the next run
        assert "Traceback" not in log and "training finished" not in log, log
    finally:
        stop_processes(serve, host)


def test_a_host_without_its_certificate_is_told_which_to_make_in_one_line(tmp_path, capsys):
    from fedpar.cli.main import main

    certs = tmp_path / "certs"
    ensure_certs(certs, ["host-0-of-2"], ["127.0.0.1"])  # another host's: this one runs alone (host-0-of-1)
    for tls, said in ((["--certs", str(certs)], f"certificate {certs / 'host-0-of-1.pem'} does not exist"),
                      ([], "TLS is required")):
        # in this process: the refusal comes before the host dials or starts a worker (no process's imports to wait)
        code = main(["simulate-workers", "--server", "127.0.0.1:1", *tls, "--clients", "4", "--dataset", "digits"])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert said in lines[0] and "fedpar certs --out" in lines[0] and "--agents host-0-of-1'" in lines[0], lines
