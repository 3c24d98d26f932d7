"""A Flower App whose ServerApp drives (``--flower-app`` without ``--strategy``) is watched as any run is:
``--metrics-port`` serves Prometheus and ``--tensorboard`` gets each Message exchange's row. Both were accepted and
silently ignored by ``simulate`` and ``serve``: no endpoint, no event file."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'fedpar[tensorboard]')")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from fedpar.cli.main import main  # noqa: E402
from support.processes import stop_processes  # noqa: E402

APP = Path(__file__).parent / "tiny_app"
ENDPOINT = re.compile(r"Prometheus metrics at http://127\.0\.0\.1:(\d+)/metrics")


def test_simulate_server_app_writes_tensorboard_rows_and_serves_metrics(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tb = tmp_path / "out", tmp_path / "tb"
    assert main(["simulate", "--flower-app", str(APP), "--clients", "3", "--workers", "1", "--metrics-port", "0",
                 "--tensorboard", str(tb), "--out", str(out)]) == 0
    assert ENDPOINT.search(capsys.readouterr().err)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4  # 2 server rounds of train and evaluate Messages
    events = EventAccumulator(str(tb))
    events.Reload()
    for key in ("reported", "upload_bytes", "round_seconds"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == \
            [(r["round"], pytest.approx(r[key])) for r in rows]


def test_serve_server_app_serves_metrics_and_writes_events_while_it_waits(tmp_path):
    tb = tmp_path / "tb"
    proc = subprocess.Popen([sys.executable, "-m", "fedpar", "serve", "--flower-app", str(APP), "--insecure",
                             "--port", "0", "--metrics-port", "0", "--tensorboard", str(tb), "--min-available", "2",
                             "--out", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = []
        for line in proc.stdout:  # the endpoint is said before the port agents dial
            said.append(line)
            if "coordinator listening on" in line:
                break
        match = ENDPOINT.search("".join(said))
        assert match, f"no metrics endpoint was printed: {''.join(said)}"
        text = urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/metrics", timeout=10).read().decode()
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
        assert got[("fedpar_round", ())] == 0
        assert got[("fedpar_agents", (("state", "registered"),))] == 0
        assert [p.name.startswith("events.out.tfevents.") for p in tb.iterdir()] == [True]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        stop_processes(proc)
