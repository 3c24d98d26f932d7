"""The deployed form of the README and docs/tutorials/first-deployment.md, as separate processes: fedpar certs,
then serve and two clients with --certs
(with the data plane forced on, so the weights also cross a TLS data socket between real processes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from support.processes import port_from

ROOT = Path(__file__).resolve().parents[2]
FEDPAR = [sys.executable, "-m", "fedpar.cli.main"]


def test_readme_deployed_form_runs_a_round_over_mutual_tls(tmp_path):
    certs = tmp_path / "certs"
    subprocess.run([*FEDPAR, "certs", "--out", str(certs), "--agents", "alice,bob"], check=True, cwd=ROOT,
                   capture_output=True, timeout=60)
    serve = subprocess.Popen([*FEDPAR, "serve", "--port", "0", "--certs", str(certs), "--min-available", "2",
                              "--clients-per-round", "2", "--rounds", "1", "--local-epochs", "1", "--lr", "0.1",
                              "--out", str(tmp_path / "run"), "--data-plane", "on"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    clients = []
    early: list[str] = []
    try:
        port = port_from(serve, early)
        clients = [subprocess.Popen([*FEDPAR, "client", "--server", f"127.0.0.1:{port}", "--certs", str(certs),
                                     "--agent-id", agent_id, "--num-partitions", "2", "--partition-index", str(i),
                                     "--threads", "1", "--give-up-after", "60"],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for i, agent_id in enumerate(["alice", "bob"])]
        outputs = [c.communicate(timeout=180)[0] for c in clients]
        serve_out = serve.communicate(timeout=60)[0]
    finally:
        for proc in [serve, *clients]:
            if proc.poll() is None:
                proc.kill()
    assert serve.returncode == 0, serve_out
    for client, out in zip(clients, outputs):
        assert client.returncode == 0 and "1 update accepted, 0 refused" in out, out
        assert "data-plane" not in out, out  # no fallback to the gRPC streams was needed
    assert '"status": "ok"' in serve_out and '"reported": 2' in serve_out
    assert re.search(r"data plane listening on 127\.0\.0\.1:\d+ \(TLS\)", "".join(early)), early
    # serve leaves what simulate leaves: the same summary (one writer) and the round plots
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds"] == 1 and summary["interrupted"] is False and summary["final_test_accuracy"] > 0
    for plot in ("accuracy.png", "loss.png"):
        assert (tmp_path / "run" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
