"""`fedpar serve --state --metrics-port`: the endpoint says whether the run it follows is running or how it ended.
Its series were the same while a run went on and after it ended (kept until the next run starts), so a dashboard
could not tell a run waiting for its agents from one that was over."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from fedpar.security.certs import ensure_certs
from support.processes import stop_processes


def _fedpar(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedpar", *args], **kwargs)


def _states(url: str, run_id: int) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {s.labels["fedpar_run_state"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "fedpar_run_state" and s.labels["run"] == str(run_id)}


def _until(predicate, what: str, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := predicate():
            return got
        time.sleep(0.1)
    raise AssertionError(what)


def test_the_service_endpoint_says_a_run_is_running_then_how_it_ended(tmp_path):
    certs, log = tmp_path / "certs", tmp_path / "serve.log"
    ensure_certs(certs, ["a1"], ["127.0.0.1"], operators=["op"])
    with log.open("w") as sink:
        service = _fedpar("serve", "--state", str(tmp_path / "state.db"), "--certs", str(certs), "--port", "0",
                          "--control-port", "0", "--control-port-file", str(tmp_path / "cport"), "--min-available",
                          "1", "--metrics-port", "0", stdout=sink, stderr=subprocess.STDOUT)
    try:
        _until(lambda: (tmp_path / "cport").exists(), f"the service did not start: {log.read_text()}")
        url = re.search(r"Prometheus metrics at (http://\S+)", log.read_text()).group(1)
        control = ["--control", f"127.0.0.1:{(tmp_path / 'cport').read_text().strip()}", "--certs", str(certs),
                   "--operator", "op"]
        (tmp_path / "run.toml").write_text("rounds = 1\n")
        submit = subprocess.run([sys.executable, "-m", "fedpar", "run", "submit", str(tmp_path / "run.toml"),
                                 *control], capture_output=True, text=True, timeout=120)
        run_id = int(submit.stdout.strip())
        # no agent: the run has started and waits for one
        assert _until(lambda: _states(url, run_id).get("running") == 1, "never running") and \
            _states(url, run_id) == {"running": 1, "finished": 0, "failed": 0, "stopped": 0}
        stop = subprocess.run([sys.executable, "-m", "fedpar", "run", "stop", str(run_id), *control],
                              capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        _until(lambda: _states(url, run_id).get("stopped") == 1, f"never stopped: {_states(url, run_id)}")
        assert _states(url, run_id) == {"running": 0, "finished": 0, "failed": 0, "stopped": 1}
    finally:
        stop_processes(service)
