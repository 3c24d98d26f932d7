"""Enrollment tokens as `fedpar certs --mint-token` writes them and `fedpar serve --enrollment-tokens` reads them:
re-minting an agent's token replaces the earlier one, which a coordinator then refuses (its line stayed in the file
beside the new one, and nothing was said); a tokens file with no token, with which no agent can enroll, is a warning
(the file is re-read while serving, so a token added later is taken: not a refusal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from fedpar.cli.main import main
from fedpar.cli.run_settings import serve_parser
from fedpar.cli.tlsopts import server_security
from fedpar.security.tls import TlsFiles, channel_credentials
from fedpar.security.admission import hash_token, mint_token, parse_token_hashes
from fedpar.security.certs import CertPaths

ROOT = Path(__file__).resolve().parents[2]
NO_TOKENS = ("holds no tokens, so no agent can enroll: add one with 'fedpar certs --out DIR --mint-token ID' (the "
             "file is re-read when it changes)")


def _rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_reminting_a_token_replaces_the_earlier_one_which_a_running_coordinator_then_refuses(
        pki, coordinator_factory, raw_agents, tmp_path, capsys):
    paths = CertPaths(tmp_path / "certs")
    assert main(["certs", "--out", str(paths.root), "--mint-token", "dave,erin"]) == 0
    old = (paths.root / "dave.token").read_text().strip()
    erin = (paths.root / "erin.token").read_text().strip()
    args = serve_parser().parse_args(["--tls-cert", str(pki.paths.server_cert), "--tls-key", str(pki.paths.server_key),
                                      "--enrollment-tokens", str(paths.tokens)])
    security = server_security(args)
    server = coordinator_factory(security.credentials, security.admission, min_available=9)
    capsys.readouterr()
    assert main(["certs", "--out", str(paths.root), "--mint-token", "dave"]) == 0  # while the coordinator runs
    said = capsys.readouterr().out.splitlines()
    assert said[0] == (f"replaced the earlier enrollment token of agent dave in {paths.tokens}: it enrolls no more (a "
                       "coordinator re-reads the file)"), said
    assert said[1:] == [f"wrote {paths.root / 'dave.token'} (give it to agent dave) and its hash to {paths.tokens}"]
    new = (paths.root / "dave.token").read_text().strip()
    assert new != old
    lines = [line.split()[0] for line in paths.tokens.read_text().splitlines()]
    assert sorted(lines) == ["dave", "erin"]  # one line an agent: the earlier hash is gone from the file
    assert parse_token_hashes(paths.tokens.read_text()) == {"dave": hash_token(new), "erin": hash_token(erin)}
    assert os.stat(paths.tokens).st_mode & 0o777 == 0o600

    agent = raw_agents(server.address, channel_credentials(TlsFiles(None, None, pki.paths.ca_cert)))
    err = _rpc_error(lambda: agent.join("dave", token=old))  # a real enrollment with the earlier token
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "wrong enrollment token for agent 'dave'" in err.details()
    assert server.coordinator.registry.get("dave") is None
    agent.join("dave", token=new)
    raw_agents(server.address, channel_credentials(TlsFiles(None, None, pki.paths.ca_cert))).join("erin", token=erin)
    assert sorted(server.coordinator.registry.snapshot()) == ["dave", "erin"]


def test_a_first_token_is_appended_and_comments_survive_a_reminting(tmp_path, capsys):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("# our federation's agents\n")
    first = mint_token(tokens, "dave")
    assert main(["certs", "--out", str(tmp_path), "--mint-token", "erin"]) == 0
    assert "replaced" not in capsys.readouterr().out  # erin had none
    assert main(["certs", "--out", str(tmp_path), "--mint-token", "dave"]) == 0
    text = tokens.read_text()
    assert text.startswith("# our federation's agents\nerin ") and hash_token(first) not in text, text


@pytest.fixture
def empty_tokens(tmp_path) -> Path:
    path = tmp_path / "tokens.txt"
    path.write_text("# tokens: 'fedpar certs --mint-token ID' adds them\n")
    return path


def test_a_tokens_file_without_a_token_is_one_warning_per_reading_and_a_token_added_later_is_taken(
        pki, empty_tokens, caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    args = serve_parser().parse_args(["--state", str(empty_tokens.parent / "state.db"), "--certs", str(pki.ours),
                                      "--enrollment-tokens", str(empty_tokens)])
    with caplog.at_level("INFO", logger="fedpar.security"):
        admissions = [server_security(args).admission for _ in range(3)]  # a service: start, agents' port, a run
        warned = [r for r in caplog.records if "holds no tokens" in r.getMessage()]
        assert [(r.levelname, r.getMessage()) for r in warned] == [
            ("WARNING", f"enrollment tokens file {empty_tokens} {NO_TOKENS}")]
        caplog.clear()
        token = mint_token(empty_tokens, "dave")
        assert admissions[0].token_hashes.refresh() == {"dave": hash_token(token)}
        admissions[1].admit_join("dave", None, token)  # no restart
        assert [r.getMessage() for r in caplog.records] == [f"read {empty_tokens}"]  # no warning now
        caplog.clear()
        empty_tokens.write_text("")  # emptied while serving: said again
        admissions[2].token_hashes.refresh()
        assert [r.levelname for r in caplog.records if "holds no tokens" in r.getMessage()] == ["WARNING"]


def test_serve_with_a_tokens_file_without_a_token_says_so_in_one_line_as_it_starts(pki, empty_tokens, tmp_path):
    port_file = tmp_path / "port"
    serve = subprocess.Popen([sys.executable, "-m", "fedpar", "serve", "--tls-cert", str(pki.paths.server_cert),
                              "--tls-key", str(pki.paths.server_key), "--enrollment-tokens", str(empty_tokens),
                              "--port", "0", "--port-file", str(port_file), "--rounds", "1", "--no-central-eval",
                              "--out", str(tmp_path / "out")], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while not port_file.exists() and serve.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert serve.poll() is None and port_file.exists(), serve.communicate()
    finally:
        serve.send_signal(signal.SIGINT)
        _, err = serve.communicate(timeout=30)
    lines = [line for line in err.splitlines() if "holds no tokens" in line]
    assert len(lines) == 1 and lines[0].endswith(f"enrollment tokens file {empty_tokens} {NO_TOKENS}"), err
    assert "Traceback" not in err, err
