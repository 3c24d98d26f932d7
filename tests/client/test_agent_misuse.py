"""`fedpar client` used wrongly, as a new user would: --server pointing at a web server (a coordinator's
--metrics-port), TLS flags half given, Ctrl-C in the middle of a round. Each ends in one line saying what to change
(or what it did), with its exit code and no traceback; none is retried for ever, and the coordinator loses nothing."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedpar.security.certs import ensure_certs

from support.in_process import run_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def web_server():
    """An HTTP/1 server on a loopback port: its address."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)  # a quick shutdown
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _said(err: str, command: str = "client") -> list[str]:
    """The lines `fedpar COMMAND` said as its own (not its log's)."""
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith(f"fedpar {command}:")]


def test_a_web_server_at_server_is_named_at_once_not_retried_for_ever(web_server, tmp_path, capfd):
    """It was 'coordinator unreachable (UNAVAILABLE)', retried without end (with --certs, or --insecure)."""
    ensure_certs(tmp_path / "certs", ["alice"])
    for tls in (["--insecure"], ["--certs", str(tmp_path / "certs")]):
        # --give-up-after: retried as unreachable (as before) it would end on another line, not hang the test
        done = run_main(["client", "--server", web_server, "--agent-id", "alice", "--threads", "1",
                         "--give-up-after", "60", *tls], capfd, cwd=tmp_path)
        assert done.returncode == 1, done.stderr
        assert "retrying" not in done.stderr, done.stderr
        assert _said(done.stderr) == [
            f"fedpar client: alice: {web_server} answers in HTTP/1, not gRPC: it is a web server (a coordinator's "
            "--metrics-port?), not a coordinator's agents' port; give --server the coordinator's --port"], done.stderr


def test_tls_flags_half_given_say_the_missing_half(tmp_path, capfd):
    """A certificate without its key was said as 'no CA certificate given' (the CA was not what was missing)."""
    certs = tmp_path / "certs"
    ensure_certs(certs, ["alice"])
    cert, key, ca = str(certs / "alice.pem"), str(certs / "alice.key"), str(certs / "ca.pem")
    cases = [(["--tls-cert", cert], f"--tls-cert {cert} needs its private key: add --tls-key KEY"),
             (["--tls-cert", cert, "--tls-ca", ca], f"--tls-cert {cert} needs its private key: add --tls-key KEY"),
             (["--tls-key", key], f"--tls-key {key} needs its certificate: add --tls-cert PEM"),
             (["--tls-cert", cert, "--tls-key", key],
              "no CA certificate given to check the coordinator with: add --tls-ca CA.pem (the ca.pem of the "
              "'fedpar certs' folder that issued the certificates), or pass --certs DIR")]
    for flags, says in cases:
        done = run_main(["client", "--server", "127.0.0.1:1", "--agent-id", "alice", "--give-up-after", "1",
                         "--threads", "1", *flags], capfd)
        assert done.returncode == 2, done.stderr
        assert _said(done.stderr) == [f"fedpar client: {says}"], done.stderr


def _fedpar(*argv: str, cwd, err) -> subprocess.Popen:
    """A real `fedpar ARGV` process, its stderr written to the file ``err``."""
    return subprocess.Popen([sys.executable, "-m", "fedpar", *argv], cwd=cwd, stdout=subprocess.DEVNULL, stderr=err,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for(path: Path, words: str, proc: subprocess.Popen) -> None:
    """Until the file ``path`` holds ``words`` (a process that ends first fails the test)."""
    while words not in path.read_text():
        assert proc.poll() is None, path.read_text()[-3000:]
        time.sleep(0.05)


def test_ctrl_c_mid_round_ends_the_agent_in_one_line_and_its_coordinator_loses_nothing(tmp_path):
    """An agent stopped as it trains its round's task (or downloads or uploads it): exit 130 and one line; the round
    fails for want of its update, the global model unchanged, and the agent started again finishes the run."""
    port_file, serve_log = tmp_path / "port", tmp_path / "serve.log"
    with open(serve_log, "w") as err:
        serve = _fedpar("serve", "--insecure", "--port", "0", "--port-file", str(port_file), "--min-available", "1",
                        "--rounds", "2", "--model", "cnn", "--local-epochs", "12", "--deadline", "120",
                        "--out", str(tmp_path / "out"), cwd=tmp_path, err=err)
    try:
        while not port_file.exists() or not port_file.read_text().strip():
            assert serve.poll() is None, serve_log.read_text()
            time.sleep(0.05)
        agent = ["client", "--server", f"127.0.0.1:{port_file.read_text().strip()}", "--insecure", "--agent-id", "a",
                 "--model", "cnn", "--threads", "1", "--device", "cpu"]
        with open(tmp_path / "agent.log", "w") as err:
            first = _fedpar(*agent, cwd=tmp_path, err=err)
        _wait_for(serve_log, "round 1: sampled", serve)
        # into its training (12 epochs of its 1,293 examples: seconds, the restarted agent's round 2 as long): any
        # phase of the round must end the same way
        time.sleep(0.5)
        first.send_signal(signal.SIGINT)
        assert first.wait(60) == 130
        said = (tmp_path / "agent.log").read_text()
        assert "Traceback" not in said and _said(said) == [
            "fedpar client: interrupted after 1 task, 0 updates accepted, 0 refused"], said
        with open(tmp_path / "again.log", "w") as err:
            again = _fedpar(*agent, cwd=tmp_path, err=err)
        assert serve.wait(300) == 0, serve_log.read_text()[-3000:]
        assert again.wait(60) == 0, (tmp_path / "again.log").read_text()[-3000:]
    finally:
        for proc in (p for p in (serve, locals().get("first"), locals().get("again")) if p is not None):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["status"]) for r in rows] == [(1, "failed"), (2, "ok")], rows
    assert "round 1 failed: 0 accepted updates < --min-reports 1; global model unchanged" in serve_log.read_text()
    assert "Traceback" not in serve_log.read_text()


def _table(path: Path, columns: int, classes: int) -> None:
    """A CSV of 80 rows: ``columns`` features, labels 0..classes-1, four clients."""
    header = ",".join(f"f{c}" for c in range(columns))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{header},label,client\n" + "".join(
        ",".join(str((i * (c + 3)) % 7 - 3) for c in range(columns)) + f",{i % classes},{i % 4}\n" for i in range(80)))


def test_a_site_whose_table_makes_another_model_is_told_what_differs_in_its_data(tmp_path, capfd):
    """It was told the tensors' shapes only ('net.0.weight' is float32[128, 4] there, float32[128, 3] here)."""
    _table(tmp_path / "hub" / "table.csv", 4, 2)
    _table(tmp_path / "narrow" / "table.csv", 3, 2)
    _table(tmp_path / "classes" / "table.csv", 4, 3)
    port_file, serve_log = tmp_path / "port", tmp_path / "serve.log"
    with open(serve_log, "w") as err:
        serve = _fedpar("serve", "--insecure", "--port", "0", "--port-file", str(port_file), "--min-available", "1",
                        "--rounds", "100", "--dataset", f"csv:{tmp_path / 'hub' / 'table.csv'}",
                        "--out", str(tmp_path / "out"), cwd=tmp_path, err=err)
    try:
        while not port_file.exists() or not port_file.read_text().strip():
            assert serve.poll() is None, serve_log.read_text()
            time.sleep(0.05)
        server = f"127.0.0.1:{port_file.read_text().strip()}"
        for site, says in (("narrow", "tensor 'net.0.weight' is float32[128, 4] there, float32[128, 3] here (the "
                                      "first layer takes 4 inputs there, 3 here: the agent's data has other "
                                      "features, e.g. a table of other columns)"),
                           ("classes", "tensor 'net.2.weight' is float32[2, 128] there, float32[3, 128] here (the "
                                       "last layer gives 2 outputs there, 3 here: the agent's labels run to another "
                                       "largest class number; every site numbers the classes alike, 0..K-1, with "
                                       "class K-1 in its data)")):
            done = run_main(["client", "--server", server, "--insecure", "--agent-id", site, "--threads", "1",
                             "--num-partitions", "4", "--dataset", f"csv:{tmp_path / site / 'table.csv'}"], capfd,
                            cwd=tmp_path)
            assert done.returncode == 1, done.stderr
            assert _said(done.stderr) == [f"fedpar client: {site}: the coordinator's model does not fit this agent's "
                                          f"task: {says}; start the agent with the coordinator's task and "
                                          "--task-option values (a Flower App: the one the coordinator's serve "
                                          "--flower-app runs)"], done.stderr
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(60)


def test_a_token_agent_given_a_certs_folder_without_its_certificate_is_told_to_pass_the_ca(tmp_path, capfd):
    """It was told 'certificate dave.pem does not exist; make certificates with fedpar certs ...'."""
    certs = tmp_path / "certs"
    ensure_certs(certs, ["alice"])
    (tmp_path / "dave.token").write_text("a-token\n")
    done = run_main(["client", "--server", "127.0.0.1:1", "--agent-id", "dave", "--certs", str(certs),
                     "--enrollment-token-file", str(tmp_path / "dave.token"), "--threads", "1"], capfd)
    assert done.returncode == 2, done.stderr
    assert _said(done.stderr) == [
        f"fedpar client: --certs {certs} holds no dave.pem: an agent admitted by --enrollment-token-file has no "
        f"certificate of its own; pass --tls-ca {certs / 'ca.pem'} instead of --certs"], done.stderr


def test_a_dataset_given_beside_a_flower_app_is_refused_not_ignored(tmp_path, capfd):
    """The ClientApp loads its own data: the agent (and `fedpar serve --flower-app`) ran without a word about it."""
    done = run_main(["client", "--server", "127.0.0.1:1", "--insecure", "--agent-id", "a", "--threads", "1",
                     "--flower-app", str(ROOT / "examples" / "flower_app"), "--dataset", "csv:table.csv"], capfd)
    assert done.returncode == 2, done.stderr
    assert _said(done.stderr) == ["fedpar client: --flower-app brings its own model and data, so --dataset would be "
                                  "ignored: drop it (its own settings are --run-config 'KEY=VALUE ...')"], done.stderr
    done = run_main(["serve", "--insecure", "--port", "0", "--flower-app", str(ROOT / "examples" / "flower_app"),
                     "--dataset", "csv:table.csv", "--out", str(tmp_path / "out")], capfd)
    assert done.returncode == 2, done.stderr
    assert _said(done.stderr, "serve") == [
        "fedpar serve: --flower-app brings its own model and data, so --dataset would be ignored: drop it (its own "
        "settings are --run-config 'KEY=VALUE ...')"], done.stderr
