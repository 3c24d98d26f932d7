"""The control API of `fedpar serve --state` under what operators do too much of: many `fedpar run logs -f` at once
(real gRPC over mutual TLS on 127.0.0.1, port 0)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import grpc
import pytest

from fedpar.cli.main import main
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol import fedpar_pb2_grpc as pb_grpc
from fedpar.security.certs import CertPaths
from fedpar.security.tls import TlsFiles, channel_credentials, server_credentials, server_tls_files
from fedpar.server import run_control
from fedpar.server.run_control import LONG_CALLS, RunControlServer
from fedpar.server.run_store import RunStore


@pytest.fixture
def served(tmp_path):
    """A control API over a run store holding one queued run (nothing executes it: it never ends): the store, an
    operator's stub, and the `fedpar run` options that reach it as that operator."""
    certs = tmp_path / "certs"
    assert main(["certs", "--out", str(certs), "--operators", "op"]) == 0
    store = RunStore(tmp_path / "state.db")
    store.log(store.submit("waits", {"rounds": 1}, who="op"), "run 1 waits for agents")  # what each follow says first
    server = RunControlServer(store, lambda settings: (settings, ""), "127.0.0.1", 0,
                              server_credentials(server_tls_files(certs)))
    paths = CertPaths(certs)
    channel = grpc.secure_channel(f"127.0.0.1:{server.port}", channel_credentials(
        TlsFiles(paths.operator_cert("op"), paths.operator_key("op"), paths.ca_cert)))
    yield SimpleNamespace(store=store, stub=pb_grpc.RunControlStub(channel),
                          options=["--control", f"127.0.0.1:{server.port}", "--certs", str(certs), "--operator", "op"])
    channel.close()
    server.stop(0)
    store.close()


@pytest.fixture
def control(served):
    """An operator's stub of :func:`served`'s control API."""
    return served.stub


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


def test_run_ls_lists_every_run_of_a_service_whose_runs_pass_one_reply(served, monkeypatch, capsys):
    """List put every run in one reply: at 3,000 runs of a sweep (about 1.7 KB each) it passed gRPC's 4 MiB and
    'fedpar run ls' said only "Received message larger than max". Now a reply holds up to LIST_REPLY_BYTES of runs
    and the command asks for the rest (here a 4 KiB page: 40 runs of about 400 bytes take several)."""
    monkeypatch.setattr(run_control, "LIST_REPLY_BYTES", 4096)
    settings = {"rounds": 5, "strategy": "fedavg", "note": "x" * 300}
    ids = [1] + [served.store.submit(f"sweep-{i}", settings, who="op") for i in range(40)]
    first = served.stub.List(pb.RunQuery(), timeout=10)
    assert first.more and len(first.runs_json) <= 4096
    pages = json.loads(first.runs_json)
    assert [r["id"] for r in pages] == ids[:len(pages)]
    assert main(["run", "ls", *served.options]) == 0
    listed = capsys.readouterr().out.splitlines()[1:]
    assert [int(line.split()[0]) for line in listed] == ids
    assert [a["action"] for a in served.store.audit_rows()].count("ls") == 2  # once a listing, not once a page
