"""Fuzz the data plane's socket framing: hostile preambles, tickets, header frames, lengths and data.

Every connection must end in a clear refusal frame or a silent close (never an accepted update), the
coordinator must keep serving with no worker, ticket, queue place or per-agent call left behind, and
the global model must not move; two valid data-plane uploads then finish the round as their exact mean.
"""

from __future__ import annotations

import socket
import time

import grpc
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpar.client import dataplane
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import FRAMING_BYTES, ModelLayout, layout_to_pb
from fedpar.protocol.dataplane import LENGTH, MAGIC, OP_DOWNLOAD, OP_UPLOAD, PREAMBLE, STATUS, VERSION

SHAPES = ((64, 32), (32,))
NAMES = ["t0", "t1"]
POOL = 20  # sampled agents the fuzzer may use up (a NaN upload spends its slot)
CHUNK = 64 << 10
CLEAR = {c.value[0] for c in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
                              grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS)}
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
PREAMBLES = ["upload", "download", "bad_magic", "bad_version", "bad_op", "unknown_ticket", "other_ticket", "short",
             "random"]
HEADERS = ["valid", "random", "empty", "wrong_round", "wrong_task", "wrong_total", "no_examples", "huge_dims",
           "bad_dtype", "nan_metric", "other_auth", "bad_token", "extra_tensor"]
LENGTHS = ["exact", "huge", "over_limit", "longer", "shorter", "zero"]
DATA = ["none", "truncated", "nan", "random"]


def _arrays(seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _header(fz, i: int, kind: str, blob: bytes) -> bytes:
    bot, task = fz.bots[i], fz.tasks[i]
    h = pb.UploadHeader(auth=bot.auth, round=task.round, task_id=task.task_id, num_examples=10, steps=1,
                        tensors=layout_to_pb(fz.layout), total_bytes=fz.layout.total_bytes)
    if kind == "random":
        return blob
    if kind == "empty":
        return b""
    if kind == "wrong_round":
        h.round = 2 + len(blob)
    elif kind == "wrong_task":
        h.task_id = fz.tasks[(i + 1) % POOL].task_id
    elif kind == "wrong_total":
        h.total_bytes += 1 + len(blob)
    elif kind == "no_examples":
        h.num_examples = -len(blob)
    elif kind == "huge_dims":
        h.tensors[0].shape[:] = [1 << 31, 1 << 31]
    elif kind == "bad_dtype":
        h.tensors[1].dtype = "object"
    elif kind == "nan_metric":
        h.metrics["loss"] = float("nan")
    elif kind == "other_auth":
        h.auth.CopyFrom(fz.bots[(i + 1) % POOL].auth)
    elif kind == "bad_token":
        h.auth.token = blob.hex()
    elif kind == "extra_tensor":
        h.tensors.add(name="t2", dtype="float32", shape=[1])
    return h.SerializeToString()


def _connection_bytes(fz, pre, i, hdr, length, data, cut, blob) -> tuple[bytes, bool]:
    """What a hostile client sends, and whether a full model download is a fine answer."""
    ticket = bytes(fz.tasks[i].data_ticket)
    preamble = {
        "upload": PREAMBLE.pack(MAGIC, VERSION, OP_UPLOAD, ticket),
        "download": PREAMBLE.pack(MAGIC, VERSION, OP_DOWNLOAD, ticket),
        "bad_magic": PREAMBLE.pack(b"FPDQ", VERSION, OP_UPLOAD, ticket),
        "bad_version": PREAMBLE.pack(MAGIC, 2 + cut % 250, OP_UPLOAD, ticket),
        "bad_op": PREAMBLE.pack(MAGIC, VERSION, 3 + cut % 250, ticket),
        "unknown_ticket": PREAMBLE.pack(MAGIC, VERSION, OP_UPLOAD, blob[:32].ljust(32, b"\7")),
        "other_ticket": PREAMBLE.pack(MAGIC, VERSION, OP_UPLOAD, bytes(fz.tasks[(i + 1) % POOL].data_ticket)),
        "short": PREAMBLE.pack(MAGIC, VERSION, OP_UPLOAD, ticket)[:cut % PREAMBLE.size],
        "random": blob,
    }[pre]
    header = _header(fz, i, hdr, blob)
    limit = fz.server.coordinator.config.max_chunk_bytes + FRAMING_BYTES
    frame = {
        "exact": LENGTH.pack(len(header)) + header,
        "huge": LENGTH.pack(0xFFFFFFFF) + header,
        "over_limit": LENGTH.pack(limit + 1) + header,
        "longer": LENGTH.pack(len(header) + 1 + cut % 1000) + header,
        "shorter": LENGTH.pack(max(0, len(header) - 1 - cut % 8)) + header,
        "zero": LENGTH.pack(0) + header,
    }[length]
    total = fz.layout.total_bytes
    if length == "shorter" or length == "zero":
        payload = b""  # the rest of the header is read as data already: never let it complete an upload
    elif data == "truncated":
        payload = fz.update_bytes[:cut % total]
    elif data == "nan":
        payload = fz.nan_bytes
    elif data == "random":
        payload = (blob * (1 + cut % 100))[:total - 1]
    else:
        payload = b""
    return preamble + frame + payload, pre == "download"


def _answer(fz, raw: bytes, download_ok: bool) -> None:
    """Send ``raw``, half-close, read everything back and check it is a refusal, a go-ahead or silence."""
    with socket.create_connection(("127.0.0.1", fz.port), timeout=10) as s:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the coordinator already hung up (e.g. on a bad preamble)
        got = bytearray()
        try:
            while chunk := s.recv(1 << 16):
                got += chunk
        except ConnectionResetError:
            pass
    pos = 0
    while pos < len(got):
        assert len(got) - pos >= STATUS.size, bytes(got[pos:])
        code, length = STATUS.unpack_from(got, pos)
        pos += STATUS.size
        body = bytes(got[pos:pos + length])
        pos += length
        if code == 0 and download_ok and body:  # the model: header, then exactly its bytes
            assert pb.ModelHeader.FromString(body).total_bytes == len(got) - pos
            return
        if code == 0:
            assert body == b"", "an upload was accepted: " + repr(body[:200])
            continue
        assert code in CLEAR and body, (code, body)
        assert pos == len(got), "nothing may follow a refusal"


def _settled(fz) -> None:
    """Workers, tickets, queue places and per-agent calls are all given back (within a moment)."""
    plane, coord = fz.server.data_plane, fz.server.coordinator
    for _ in range(200):
        busy = [e for e in coord.tickets._live.values() if "busy" in e.ops.values()]
        free = not plane.busy
        if free and not busy and plane.intake.queued == 0 and not plane.limits._calls:
            break
        time.sleep(0.01)
    assert not plane.busy and not len(plane.strangers), "a data-plane connection was not released"
    assert not [e for e in coord.tickets._live.values() if "busy" in e.ops.values()], "a ticket stayed busy"
    assert plane.intake.queued == 0 and not plane.limits._calls, "a limit was not released"
    assert fz.server.error is None and plane._thread.is_alive()
    state = coord.current
    assert state.round_id == 1 and not state.closed and state.accepted == 0
    assert all(a.tobytes() == b.tobytes() for a, b in zip(coord.weights, fz.init))


class _Fuzz:
    def __init__(self, server, bots):
        self.server, self.bots = server, bots
        self.init = [w.copy() for w in server.coordinator.weights]
        self.layout = ModelLayout.of_arrays(NAMES, self.init)
        self.tasks = [b.task() for b in bots]
        self.port = server.coordinator.data_port
        self.update_bytes = b"".join(a.tobytes() for a in _arrays(1))
        nan = _arrays(2)
        nan[0][3, 4] = np.nan
        self.nan_bytes = b"".join(a.tobytes() for a in nan)


def test_fuzz_data_plane_framing(start_coordinator, agents):
    n = POOL + 2
    server = start_coordinator(_arrays(0), data_plane=True, clients_per_round=2, overselect=n / 2, min_available=n,
                               deadline_seconds=600, liveness_timeout_seconds=600, max_chunk_bytes=CHUNK,
                               max_upload_attempts_per_round=10_000)
    fz = _Fuzz(server, agents(server.address, [f"p{k:02d}" for k in range(n)]))

    @FUZZ
    @given(pre=st.just("upload") | st.sampled_from(PREAMBLES), i=st.integers(0, POOL - 1),
           hdr=st.just("valid") | st.sampled_from(HEADERS), length=st.just("exact") | st.sampled_from(LENGTHS),
           data=st.sampled_from(DATA), cut=st.integers(0, 1 << 20), blob=st.binary(max_size=64))
    def run(pre, i, hdr, length, data, cut, blob):
        _answer(fz, *_connection_bytes(fz, pre, i, hdr, length, data, cut, blob))
        _settled(fz)

    for pre in PREAMBLES:  # every kind at least once, whatever hypothesis draws
        for hdr in HEADERS:
            _answer(fz, *_connection_bytes(fz, pre, 3, hdr, "exact", "truncated", 1000, b"\1" * 40))
    for length in LENGTHS:
        for data in DATA:
            _answer(fz, *_connection_bytes(fz, "upload", 4 + DATA.index(data), "valid", length, data, 999, b"\2"))
    _settled(fz)
    run()
    assert server.coordinator.current.rejected > 0  # NaN updates got as far as the scan: the fuzzer reached deep

    # Two valid uploads over the data plane (from agents the fuzzer never used) close the round.
    updates, counts = [_arrays(5), _arrays(6)], [30, 70]
    for i, update, count in zip((POOL, POOL + 1), updates, counts):
        target = dataplane.DataPlaneTarget(server.address, fz.tasks[i])
        assert dataplane.upload(target, fz.bots[i].auth, fz.tasks[i], fz.layout, update, count, 1, {}, 20).accepted
    assert server.wait(30)
    row = server.coordinator.metrics.last
    assert (row["status"], row["reported"]) == ("ok", 2), row
    for got, x, y in zip(server.coordinator.weights, *updates):
        np.testing.assert_allclose(got, (30 * x.astype(np.float64) + 70 * y) / 100, rtol=1e-6, atol=1e-7)
