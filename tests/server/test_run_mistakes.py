"""The control API of `fedpar serve --state` under what operators do too much of: many `fedpar run logs -f` at once
(real gRPC over mutual TLS on 127.0.0.1, port 0)."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from fedpar.cli.main import main
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol import fedpar_pb2_grpc as pb_grpc
from fedpar.security.certs import CertPaths
from fedpar.security.tls import TlsFiles, channel_credentials, server_credentials, server_tls_files
from fedpar.server.run_control import LONG_CALLS, RunControlServer
from fedpar.server.run_store import RunStore


@pytest.fixture
def control(tmp_path):
    """A control API over a run store holding one queued run (nothing executes it: it never ends), and a stub of
    an operator's."""
    certs = tmp_path / "certs"
    assert main(["certs", "--out", str(certs), "--operators", "op"]) == 0
    store = RunStore(tmp_path / "state.db")
    store.log(store.submit("waits", {"rounds": 1}, who="op"), "run 1 waits for agents")  # what each follow says first
    server = RunControlServer(store, lambda settings: (settings, ""), "127.0.0.1", 0,
                              server_credentials(server_tls_files(certs)))
    paths = CertPaths(certs)
    channel = grpc.secure_channel(f"127.0.0.1:{server.port}", channel_credentials(
        TlsFiles(paths.operator_cert("op"), paths.operator_key("op"), paths.ca_cert)))
    yield pb_grpc.RunControlStub(channel)
    channel.close()
    server.stop(0)
    store.close()


def test_follows_cannot_take_every_thread_from_ls_and_stop(control):
    # 8 'run logs -f' took all 8 threads: ls, submit and stop then waited 30 s for 'Deadline Exceeded'
    follows = [control.Logs(pb.RunLogsRequest(run_id=1, follow=True)) for _ in range(LONG_CALLS)]
    try:
        for stream in follows:
            assert next(stream).line == "run 1 waits for agents"  # each is under way, holding its thread
        started = time.monotonic()
        runs = json.loads(control.List(pb.RunQuery(), timeout=10).runs_json)
        assert [r["status"] for r in runs] == ["queued"] and time.monotonic() - started < 5
        with pytest.raises(grpc.RpcError) as refused:  # one follow more: refused at once, in one line
            next(control.Logs(pb.RunLogsRequest(run_id=1, follow=True), timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{LONG_CALLS} follows ('fedpar run logs -f')" in refused.value.details()
        assert json.loads(control.Stop(pb.RunRef(run_id=1), timeout=10).runs_json)[0]["status"] == "queued"  # was
        assert json.loads(control.List(pb.RunQuery(), timeout=10).runs_json)[0]["status"] == "stopped"
    finally:
        for stream in follows:
            stream.cancel()
    # the followers saw the run end; a follow that left gives its slot back
    deadline = time.monotonic() + 10
    while True:
        try:
            assert list(control.Logs(pb.RunLogsRequest(run_id=1, follow=True), timeout=10))[-1].status == "stopped"
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.2)
