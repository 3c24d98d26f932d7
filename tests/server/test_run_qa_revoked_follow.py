"""An operator revoked (`fedpar certs --revoke NAME`) while following a run with `fedpar run logs ID -f` went on
receiving the run's log for as long as the run lasted (days, for a long one), though every other call of theirs was
refused at once. The follow now ends, refused as their other calls are, at its next poll. Real gRPC over mutual TLS
on 127.0.0.1 (port 0), the real revocation list and `fedpar certs`."""

from __future__ import annotations

import grpc
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol import fedpar_pb2_grpc as pb_grpc
from fedpar.security.admission import RevocationList
from fedpar.security.certs import CertPaths, ensure_certs
from fedpar.security.tls import TlsFiles, channel_credentials, server_credentials, server_tls_files
from fedpar.server.run_control import RunControlServer
from fedpar.server.run_store import RunStore
from support.in_process import run_main


def test_a_follow_of_an_operator_revoked_meanwhile_ends_refused(tmp_path, capfd):
    certs = tmp_path / "certs"
    ensure_certs(certs, operators=["op", "leaver"])
    paths = CertPaths(certs)
    store = RunStore(tmp_path / "state.db")
    run_id = store.submit("long", {"rounds": 1}, who="op")  # queued for good: nothing executes it
    store.log(run_id, f"run {run_id} waits for agents")
    server = RunControlServer(store, lambda settings: (settings, ""), "127.0.0.1", 0,
                              server_credentials(server_tls_files(certs)), RevocationList(paths.revoked))
    channel = grpc.secure_channel(f"127.0.0.1:{server.port}", channel_credentials(
        TlsFiles(paths.operator_cert("leaver"), paths.operator_key("leaver"), paths.ca_cert)))
    try:
        follow = pb_grpc.RunControlStub(channel).Logs(pb.RunLogsRequest(run_id=run_id, follow=True), timeout=20)
        assert next(follow).line == f"run {run_id} waits for agents"  # under way
        assert run_main(["certs", "--out", str(certs), "--revoke", "leaver"], capfd).returncode == 0
        with pytest.raises(grpc.RpcError) as refused:  # before: nothing more came until the 20 s ran out
            next(follow)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
        assert "operator 'leaver' was revoked" in refused.value.details()
        assert ("leaver", "refused logs") in [(a["who"], a["action"]) for a in store.audit_rows()]
    finally:
        channel.close()
        server.stop(0)
        store.close()
