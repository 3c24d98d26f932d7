"""Fuzz every RPC over a real loopback channel with raw bytes: malformed protobufs and hostile headers.

The coordinator must answer each with a clear status (never UNKNOWN/INTERNAL), keep serving, keep its
round loop alive, and fold nothing: the round is then finished by two valid updates and the new global
model must be exactly their weighted mean.
"""

from __future__ import annotations

import math
import struct

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpar.aggregation import build_strategy
from fedpar.client.transfer import upload_messages
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import (PROTOCOL_VERSION, SERVICE_NAME, ModelLayout, channel_options, encode_data_message,
                                   encode_varint)
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator

SHAPES = ((6, 4), (4,))
NAMES = ["t0", "t1"]
POOL = 100  # sampled agents whose slots the fuzzer may burn
CHUNK = 2 << 20  # large enough that a 100k-tensor header reaches the parser
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS}
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _arrays(seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


class Fuzzer:
    """A running coordinator in round 1 with POOL + 2 sampled agents, and raw-bytes callables."""

    def __init__(self):
        self.init = _arrays(0)
        self.layout = ModelLayout.of_arrays(NAMES, self.init)
        n = POOL + 2
        config = CoordinatorConfig(rounds=1, clients_per_round=2, overselect=n / 2, min_available=n,
                                   deadline_seconds=600, heartbeat_seconds=0.2, liveness_timeout_seconds=600,
                                   max_chunk_bytes=CHUNK, max_upload_attempts_per_round=10_000)
        self.server = CoordinatorServer(Coordinator(config, NAMES, self.init, build_strategy("fedavg")))
        self.server.start()
        self.channel = grpc.insecure_channel(self.server.address, options=channel_options(4 << 20))
        raw = lambda b: b  # noqa: E731
        method = lambda name: f"/{SERVICE_NAME}/{name}"  # noqa: E731
        self.unary = {name: self.channel.unary_unary(method(name), request_serializer=raw, response_deserializer=raw)
                      for name in ("Join", "PullTask", "Heartbeat", "Leave", "UploadSmall")}
        self.download = self.channel.unary_stream(method("DownloadWeights"), request_serializer=raw,
                                                  response_deserializer=raw)
        self.upload = self.channel.stream_unary(method("UploadUpdate"), request_serializer=raw,
                                                response_deserializer=raw)
        self.auths, self.tasks = [], []
        for i in range(n):
            reply = pb.JoinReply.FromString(self.unary["Join"](
                pb.JoinRequest(agent_id=f"p{i:03d}", num_examples=100).SerializeToString(), timeout=10))
            self.auths.append(pb.AgentAuth(agent_id=f"p{i:03d}", token=reply.token))
        for auth in self.auths:
            while True:
                got = pb.PullTaskReply.FromString(self.unary["PullTask"](
                    pb.PullTaskRequest(auth=auth, wait_seconds=1.0).SerializeToString(), timeout=10))
                if got.WhichOneof("kind") == "task":
                    self.tasks.append(got.task)
                    break
        self.next_agent = 0

    def agent(self) -> int:
        """The next pool agent (cycling), so final rejections do not stop the fuzzer reaching deep code."""
        self.next_agent = (self.next_agent + 1) % POOL
        return self.next_agent

    def expect_clear(self, call, ok_allowed=True):
        """Run ``call``; it may succeed (if allowed) or fail with a clear status, never a crash-like one."""
        try:
            result = call()
        except grpc.RpcError as err:
            assert err.code() in CLEAR, (err.code(), err.details())
            assert err.details(), "a refusal must say why"
            return None
        assert ok_allowed, "a hostile request was accepted"
        return result

    def alive(self):
        """The coordinator still serves valid calls and its round loop is running."""
        assert self.server.error is None and not self.server._finished.is_set()
        state = self.server.coordinator.current
        assert state is not None and state.round_id == 1 and not state.closed and state.accepted == 0
        assert all(a.tobytes() == b.tobytes() for a, b in zip(self.server.coordinator.weights, self.init))
        auth = self.auths[-1]
        pb.HeartbeatReply.FromString(self.unary["Heartbeat"](
            pb.HeartbeatRequest(auth=auth).SerializeToString(), timeout=10))

    def close(self):
        self.channel.close()
        self.server.stop()


@pytest.fixture(scope="module")
def fz():
    fuzzer = Fuzzer()
    yield fuzzer
    fuzzer.close()


def _field(number: int, wire: int, payload: bytes) -> bytes:
    """One protobuf field with an arbitrary wire type (so types can be wrong on purpose)."""
    key = encode_varint((number << 3) | wire)
    if wire == 0:
        return key + encode_varint(int.from_bytes(payload[:9].ljust(1, b"\0"), "little") % (1 << 64))
    if wire == 1:
        return key + payload[:8].ljust(8, b"\0")
    if wire == 5:
        return key + payload[:4].ljust(4, b"\0")
    return key + encode_varint(len(payload)) + payload


wrong_types = st.lists(st.tuples(st.integers(1, 12), st.sampled_from([0, 1, 2, 5]), st.binary(max_size=40)),
                       max_size=6).map(lambda fields: b"".join(_field(*f) for f in fields))
mangled = st.one_of(st.binary(max_size=300), wrong_types)


def _valid_unary(fz: Fuzzer, name: str) -> bytes:
    auth = fz.auths[fz.agent()]
    if name == "Join":
        return pb.JoinRequest(agent_id="fz", num_examples=5, capabilities={"k": "v"},
                              protocol_version=PROTOCOL_VERSION)\
            .SerializeToString()
    if name == "PullTask":
        return pb.PullTaskRequest(auth=auth, wait_seconds=0.0).SerializeToString()
    if name == "Heartbeat":
        return pb.HeartbeatRequest(auth=auth).SerializeToString()
    return pb.LeaveRequest(auth=pb.AgentAuth(agent_id=auth.agent_id, token="not-the-token")).SerializeToString()


def test_fuzz_every_rpc(fz):
    """One coordinator, every RPC fuzzed in turn; then the round finishes on valid updates only."""

    @FUZZ
    @given(name=st.sampled_from(["Join", "PullTask", "Heartbeat", "Leave"]), body=mangled,
           cut=st.integers(0, 200), flip=st.integers(0, 400))
    def unary_calls(name, body, cut, flip):
        fz.expect_clear(lambda: fz.unary[name](body, timeout=10))
        valid = bytearray(_valid_unary(fz, name))
        fz.expect_clear(lambda: fz.unary[name](bytes(valid[:cut % (len(valid) + 1)]), timeout=10))
        if name != "Join":  # a flipped Join may well be a valid Join of another agent: allowed
            valid[flip % len(valid)] ^= 0x5A
            fz.expect_clear(lambda: fz.unary[name](bytes(valid), timeout=10))

    @FUZZ
    @given(wait=st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False)  # other tests flush denormals
           | st.sampled_from([-1e308, 1e308, 0.0]))
    def pull_waits(wait):
        i = fz.agent()
        reply = fz.expect_clear(lambda: fz.unary["PullTask"](
            pb.PullTaskRequest(auth=fz.auths[i], wait_seconds=wait).SerializeToString(), timeout=5))
        assert reply is not None
        reply = pb.PullTaskReply.FromString(reply)
        # An agent that has not downloaded its task yet is handed the same task again; otherwise it waits.
        assert reply.WhichOneof("kind") == "wait_seconds" or reply.task.task_id == fz.tasks[i].task_id

    @FUZZ
    @given(body=mangled, round_id=st.sampled_from([0, 1, 2, (1 << 64) - 1]), task=st.text(max_size=20),
           own_task=st.booleans())
    def downloads(body, round_id, task, own_task):
        fz.expect_clear(lambda: list(fz.download(body, timeout=10)), ok_allowed=False)
        i = fz.agent()
        task_id = fz.tasks[i].task_id if own_task else task
        request = pb.DownloadRequest(auth=fz.auths[i], round=round_id, task_id=task_id).SerializeToString()
        # Downloading one's own round is legitimate (read-only); anything else is refused.
        fz.expect_clear(lambda: list(fz.download(request, timeout=10)), ok_allowed=own_task and round_id == 1)

    unary_calls()
    fz.alive()
    pull_waits()
    downloads()
    fz.alive()
    fuzz_uploads(fz)
    fz.alive()
    hostile_headers(fz)
    fz.alive()
    hostile_data(fz)
    fz.alive()
    small_uploads(fz)
    fz.alive()

    # Only the two valid updates count.
    a, b = POOL, POOL + 1
    updates, counts = [_arrays(1), _arrays(2)], [30, 70]
    for i, update, n in zip((a, b), updates, counts):
        msgs = upload_messages(fz.auths[i], fz.tasks[i], fz.layout, update, n, 1, {}, CHUNK)
        reply = pb.UploadReply.FromString(fz.upload(iter([_raw(m) for m in msgs]), timeout=10))
        assert reply.accepted
    assert fz.server.wait(30)
    expected = [(30 * u1.astype(np.float64) + 70 * u2.astype(np.float64)) / 100 for u1, u2 in zip(*updates)]
    for new, exp in zip(fz.server.coordinator.weights, expected):
        np.testing.assert_allclose(new, exp, rtol=1e-6, atol=1e-7)
    row = fz.server.coordinator.metrics.last
    assert (row["status"], row["reported"]) == ("ok", 2)


def _raw(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def fuzz_uploads(fz: Fuzzer):
    """Streams of random / truncated / retyped messages."""
    @FUZZ
    @given(parts=st.lists(mangled, min_size=0, max_size=5), cut=st.integers(0, 400), head_first=st.booleans())
    def run(parts, cut, head_first):
        i = fz.agent()
        header = pb.UploadChunk(header=pb.UploadHeader(
            auth=fz.auths[i], round=1, task_id=fz.tasks[i].task_id, num_examples=10,
            tensors=[pb.TensorSpec(name=n, dtype="float32", shape=list(s)) for n, s in zip(NAMES, SHAPES)],
            total_bytes=fz.layout.total_bytes)).SerializeToString()
        stream = ([header[:cut % (len(header) + 1)]] if head_first else []) + parts
        fz.expect_clear(lambda: fz.upload(iter(stream), timeout=10), ok_allowed=False)
    run()


def small_uploads(fz: Fuzzer):
    """UploadSmall with random bytes, truncated messages, data of the wrong length, and NaN in the data."""
    @FUZZ
    @given(body=mangled, cut=st.integers(0, 400), extra=st.binary(max_size=64), nan_at=st.integers(0, 1000),
           inf=st.booleans())
    def run(body, cut, extra, nan_at, inf):
        call = fz.unary["UploadSmall"]
        fz.expect_clear(lambda: call(body, timeout=10), ok_allowed=False)
        i = fz.agent()
        header = pb.UploadHeader(
            auth=fz.auths[i], round=1, task_id=fz.tasks[i].task_id, num_examples=10,
            tensors=[pb.TensorSpec(name=n, dtype="float32", shape=list(s)) for n, s in zip(NAMES, SHAPES)],
            total_bytes=fz.layout.total_bytes)
        arrays = _arrays(3)
        good = b"".join(a.tobytes() for a in arrays)
        message = pb.SmallUpload(header=header, data=good).SerializeToString()
        fz.expect_clear(lambda: call(message[:cut % len(message)], timeout=10), ok_allowed=False)
        longer = pb.SmallUpload(header=header, data=good + extra + b"x").SerializeToString()
        fz.expect_clear(lambda: call(longer, timeout=10), ok_allowed=False)
        flat = arrays[nan_at % 2].reshape(-1)
        flat[nan_at % flat.size] = np.inf if inf else np.nan
        poisoned = pb.SmallUpload(header=header, data=b"".join(a.tobytes() for a in arrays)).SerializeToString()
        fz.expect_clear(lambda: call(poisoned, timeout=10), ok_allowed=False)
    run()


HEADER_DEFECTS = ["negative_dim", "huge_dim", "absurd_dtype", "duplicate_name", "extra_tensor", "missing_tensor",
                  "many_tensors", "wrong_round", "wrong_task", "bad_examples", "nan_metric", "wrong_total",
                  "negative_steps", "too_many_dims"]


def hostile_headers(fz: Fuzzer):
    """Well-formed protobufs whose headers lie in one way or another."""
    @settings(FUZZ, max_examples=30)
    @given(defect=st.sampled_from(HEADER_DEFECTS), dim=st.integers(-(1 << 63), (1 << 63) - 1),
           dtype=st.text(max_size=12) | st.sampled_from(["object", "O", "complex128", "float32 ", "<f4", "V8"]),
           rid=st.integers(0, (1 << 64) - 1), examples=st.integers(-(1 << 63), (1 << 63) - 1))
    def run(defect, dim, dtype, rid, examples):
        _hostile_header(fz, defect, dim, dtype, rid, examples)
    for defect in HEADER_DEFECTS:  # each defect at least once, whatever hypothesis draws
        _hostile_header(fz, defect, -3, "object", 7, 0)
    run()


def _hostile_header(fz: Fuzzer, defect: str, dim: int, dtype: str, rid: int, examples: int) -> None:
    i = fz.agent()
    specs = [pb.TensorSpec(name=n, dtype="float32", shape=list(s)) for n, s in zip(NAMES, SHAPES)]
    header = pb.UploadHeader(auth=fz.auths[i], round=1, task_id=fz.tasks[i].task_id, num_examples=10,
                             total_bytes=fz.layout.total_bytes)
    if defect == "negative_dim":
        specs[0].shape[0] = -(abs(dim) % (1 << 62)) - 1
    elif defect == "huge_dim":
        big = min(max(abs(dim), 1 << 31), (1 << 63) - 1)
        specs[0].shape[:] = [big, big]
    elif defect == "absurd_dtype":
        specs[1].dtype = dtype if dtype != "float32" else "float32x"
    elif defect == "duplicate_name":
        specs[1].name = specs[0].name
    elif defect == "extra_tensor":
        specs.append(pb.TensorSpec(name="t2", dtype="float32", shape=[1]))
    elif defect == "missing_tensor":
        specs.pop()
    elif defect == "many_tensors":
        specs = [pb.TensorSpec(name=f"x{k}", dtype="uint8", shape=[1]) for k in range(100_000)]
    elif defect == "wrong_round":
        header.round = rid if rid != 1 else 2
    elif defect == "wrong_task":
        header.task_id = fz.tasks[(i + 1) % POOL].task_id
    elif defect == "bad_examples":
        cap = 100 * fz.server.coordinator.config.local_epochs  # registered examples x epochs: the most it may claim
        header.num_examples = examples if not 1 <= examples <= cap else -examples
    elif defect == "nan_metric":
        header.metrics["loss"] = math.nan
    elif defect == "wrong_total":
        header.total_bytes = fz.layout.total_bytes + 1 + (abs(dim) % 1000)
    elif defect == "negative_steps":
        header.steps = -1 - (abs(dim) % 1000)
    elif defect == "too_many_dims":
        specs[1].shape[:] = [1] * 9
    header.tensors.extend(specs)
    data = list(upload_messages(fz.auths[i], fz.tasks[i], fz.layout, _arrays(5), 10, 1, {}, CHUNK))[1:]
    stream = [pb.UploadChunk(header=header).SerializeToString()] + [_raw(m) for m in data]
    fz.expect_clear(lambda: fz.upload(iter(stream), timeout=30), ok_allowed=False)


DATA_DEFECTS = ["nan", "inf", "past_end", "overlap", "gap", "oversize", "empty_chunk", "end_totals", "no_end",
                "two_headers", "huge_offset"]


def hostile_data(fz: Fuzzer):
    """A valid header followed by data that lies: NaN, bad offsets, oversized chunks, wrong totals."""
    @settings(FUZZ, max_examples=30)
    @given(defect=st.sampled_from(DATA_DEFECTS), pos=st.integers(0, 111), size=st.integers(1, 200))
    def run(defect, pos, size):
        _hostile_data(fz, defect, pos, size)
    for defect in DATA_DEFECTS:
        _hostile_data(fz, defect, 5, 3)
    run()


def _hostile_data(fz: Fuzzer, defect: str, pos: int, size: int) -> None:
    i = fz.agent()
    arrays = _arrays(9)
    if defect in ("nan", "inf"):
        flat = arrays[pos % 2].reshape(-1)
        flat[pos % flat.size] = np.nan if defect == "nan" else -np.inf
    msgs = [_raw(m) for m in upload_messages(fz.auths[i], fz.tasks[i], fz.layout, arrays, 10, 1, {}, 16)]
    header, data, end = msgs[0], msgs[1:-1], msgs[-1]
    total = fz.layout.total_bytes
    if defect == "past_end":
        data[-1] = encode_data_message(total - 16, b"\1" * (16 + size))  # the last chunk runs past the end
    elif defect == "overlap":
        data.insert(3, encode_data_message(max(0, 48 - size % 48), b"\2" * 16))
    elif defect == "gap":
        data[2] = encode_data_message(32 + size, b"\3" * 16)
    elif defect == "oversize":
        data[0] = encode_data_message(0, b"\4" * (CHUNK + size))
    elif defect == "empty_chunk":
        data.insert(pos % len(data), encode_data_message(16 * (pos % len(data)), b""))
    elif defect == "end_totals":
        end = pb.UploadChunk(end=pb.UploadEnd(total_bytes=total + size, num_chunks=len(data))).SerializeToString()
    elif defect == "no_end":
        end = None
    elif defect == "two_headers":
        data.insert(pos % len(data), header)
    elif defect == "huge_offset":
        data[1] = encode_data_message((1 << 64) - size, b"\5" * 16)
    stream = [header] + data + ([end] if end else [])
    fz.expect_clear(lambda: fz.upload(iter(stream), timeout=30), ok_allowed=False)


def test_the_fuzzer_wire_helpers_make_what_they_claim():
    assert _field(1, 2, b"ab") == b"\x0a\x02ab"
    assert _field(2, 1, b"") == b"\x11" + b"\0" * 8
    assert struct.unpack("<I", _field(3, 5, b"\x01")[1:])[0] == 1
