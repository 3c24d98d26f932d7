"""A certificate whose private key is gone from the 'fedpar certs' folder (deleted, or never copied): serve, client and
run said 'private key DIR/X.key does not exist; make certificates with 'fedpar certs --out certs --agents ID1,ID2' and
pass '--certs certs', or pass '--insecure' ...', and doing that kept the certificate there ('kept X.pem'), so the same
line came again (run has no --insecure either). Each now says to re-issue that pair, which works. The commands' mains
in this process, the certificates from the real command."""

from __future__ import annotations

from fedpar.security.certs import ensure_certs
from fedpar.security.tls import TlsFiles, load_pair
from support.in_process import run_main


def _one_line(done) -> str:
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done
    return lines[0]


def test_a_lost_key_says_to_reissue_its_pair_and_doing_so_works(tmp_path, capfd):
    certs = tmp_path / "certs"
    ensure_certs(certs, ["alice"], operators=["op"])
    for key in ("server.key", "alice.key", "operators/op.key"):
        (certs / key).unlink()
    serve = run_main(["serve", "--state", str(tmp_path / "state.db"), "--certs", str(certs), "--port", "0",
                      "--control-port", "0"], capfd)
    assert _one_line(serve) == (
        f"fedpar serve: private key {certs / 'server.key'} does not exist beside its certificate "
        f"{certs / 'server.pem'}; give the key made with it, or re-issue the pair: 'fedpar certs --out DIR "
        "--server-name NAME' (one per name agents dial)"), serve.stderr
    client = run_main(["client", "--server", "127.0.0.1:1", "--certs", str(certs), "--agent-id", "alice"], capfd)
    assert _one_line(client) == (
        f"fedpar client: private key {certs / 'alice.key'} does not exist beside its certificate "
        f"{certs / 'alice.pem'}; give the key made with it, or re-issue the pair: 'fedpar certs --out DIR --agents "
        "alice --force'"), client.stderr
    ls = run_main(["run", "ls", "--control", "127.0.0.1:1", "--certs", str(certs), "--operator", "op"], capfd)
    assert _one_line(ls) == (
        f"fedpar run: private key {certs / 'operators/op.key'} does not exist beside its certificate "
        f"{certs / 'operators/op.pem'}; give the key made with it, or re-issue the pair: 'fedpar certs --out DIR "
        "--operators op --force'"), ls.stderr
    # as the lines say: each pair is whole again
    for args in (["--server-name", "127.0.0.1"], ["--agents", "alice", "--force"], ["--operators", "op", "--force"]):
        assert run_main(["certs", "--out", str(certs), *args], capfd).returncode == 0
    for cert, key, usage in (("server.pem", "server.key", "server"), ("alice.pem", "alice.key", "client"),
                             ("operators/op.pem", "operators/op.key", "client")):
        load_pair(TlsFiles(certs / cert, certs / key, certs / "ca.pem"), usage)
