"""The aggregator ranks' control messages (fedpar.proto's RankBroadcast and RankControl's): one codec takes each
message whole or refuses it with a line that names the sender and the problem; rank 0's RankControl service
refuses a malformed call naming the rank; with the coordinator's certificates it speaks only TLS."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.security.certs import temporary_cert_dir
from fedpar.security.tls import server_tls_files
from fedpar.server.ranks.control import RANK_HEADER, REQUESTS, SECRET_HEADER, SERVICE, RankControlClient, \
    add_control_port, control_handler, plaintext_warning
from fedpar.server.ranks.messages import RankMessageError, decode, encode, serial_bytes, serial_number
from fedpar.server.rounds import Refusal

UPLOAD = pb.RankUpload(round=3, agent_id="agent-7", task_id="t-3-7", num_examples=120,
                       metrics={"loss": 0.25, "accuracy": 0.875}, upload_bytes=4096)
COUNT = pb.RankUploads(uploads=[UPLOAD], count=1)
AGENT = pb.RankAgent(rank=1, agent_id="agent-7", task_id="t-3-7", token="tok", num_examples=120,
                     cert_serial=serial_bytes(2 ** 159 + 11), ticket=b"\x01" * 16, host="host-0")
BROADCASTS = {
    "start": pb.RankBroadcast(start=pb.RankStart(round=0, control="127.0.0.1:5000", secret="s3cret")),
    "open": pb.RankBroadcast(open=pb.RankOpen(round=3, deadline_seconds=30.0, agents=[
        AGENT, pb.RankAgent(rank=2, agent_id="agent-8", task_id="t-3-8", token="t8", num_examples=0,
                            cert_serial=b"", ticket=b"", host="")],
        hosts=[pb.RankHost(host_id="host-0", token="host-tok", cert_serial=serial_bytes(2 ** 64))])),
    "close": pb.RankBroadcast(close=pb.RankClose(round=3, expected=[4, 2, 0])),
    "model": pb.RankBroadcast(model=pb.RankModel(round=3, changed=False)),
    "stop": pb.RankBroadcast(stop=pb.RankStop()),
    "tick": pb.RankBroadcast(tick=pb.RankTick()),
}
CALLS = {
    "Count": COUNT,
    "Reject": pb.RankRejection(round=3, agent_id="agent-7", task_id="t-3-7", counted=UPLOAD, reason="NaN in fc.w"),
    "Downloaded": pb.RankDownload(round=3, agent_id="agent-7", task_id="t-3-7"),
    "Alive": pb.RankAlive(),
}
EXAMPLES = [*BROADCASTS.values(), *CALLS.values(), pb.RankAck()]


def label(message) -> str:
    """A test id: the message's name, and a broadcast's kind."""
    name = message.DESCRIPTOR.name
    return f"{name}.{message.WhichOneof('kind')}" if name == "RankBroadcast" else name


def test_every_rank_message_of_the_proto_has_an_example_here():
    rank_messages = {name for name in pb.DESCRIPTOR.message_types_by_name if name.startswith("Rank")}
    seen = set()

    def walk(message):
        seen.add(message.DESCRIPTOR.name)
        for field, value in message.ListFields():
            if field.message_type is not None and not field.message_type.GetOptions().map_entry:
                for inner in (value if field.is_repeated else [value]):
                    walk(inner)
    for example in EXAMPLES:
        walk(example)
    assert seen == rank_messages
    assert set(BROADCASTS) == {f.name for f in pb.RankBroadcast.DESCRIPTOR.oneofs_by_name["kind"].fields}
    assert set(CALLS) == set(REQUESTS) == {m.name for m in SERVICE.methods}


@pytest.mark.parametrize("message", EXAMPLES, ids=label)
def test_every_message_round_trips(message):
    back = decode(type(message), encode(message), "rank 0")
    assert back == message
    assert back.SerializeToString(deterministic=True) == message.SerializeToString(deterministic=True)  # maps: any order


def test_a_serial_number_of_any_size_round_trips_and_none_stays_none():
    for serial in (None, 0, 1, 255, 256, 2 ** 64, 2 ** 159 + 11):
        assert serial_number(serial_bytes(serial)) == serial
    assert decode(pb.RankAgent, encode(AGENT), "rank 0").cert_serial == AGENT.cert_serial


@pytest.mark.parametrize("message", [*BROADCASTS.values(), *(m for m in CALLS.values() if m.ByteSize())], ids=label)
def test_every_cut_of_a_message_is_refused_naming_the_sender(message):
    data = encode(message)
    for size in range(len(data)):
        with pytest.raises(RankMessageError, match=f"^aggregator rank 2 sent .*{message.DESCRIPTOR.name}"):
            decode(type(message), data[:size], "aggregator rank 2")


@pytest.mark.parametrize("garbled, says", [
    (b"\xff\xff\xff\xff", "4 bytes that are not a RankUpload"),  # no such wire type
    (b"\x12\x40agent", "7 bytes that are not a RankUpload"),  # a string longer than the message
    (b"\x08" + b"\xff" * 11, "12 bytes that are not a RankUpload"),  # a varint past 64 bits
])
def test_garbled_bytes_are_refused_saying_what_they_are_not(garbled, says):
    with pytest.raises(RankMessageError, match=f"^aggregator rank 3 sent {says}"):
        decode(pb.RankUpload, garbled, "aggregator rank 3")


@pytest.mark.parametrize("field", [f.name for f in pb.RankUpload.DESCRIPTOR.fields if f.name != "metrics"])
def test_a_control_call_without_a_field_is_refused_naming_it(field):
    upload = pb.RankUpload()
    upload.CopyFrom(UPLOAD)
    upload.ClearField(field)
    with pytest.raises(RankMessageError, match=f"^aggregator rank 1 sent a RankUpload without its {field}$"):
        decode(pb.RankUpload, upload.SerializeToString(), "aggregator rank 1")
    with pytest.raises(ValueError, match=f"RankUpload without its {field} was about to be sent"):
        encode(upload)  # nor does this side send one


def test_a_missing_field_deep_in_a_broadcast_is_named_by_its_path():
    message = pb.RankBroadcast()
    message.CopyFrom(BROADCASTS["open"])
    message.open.agents[1].ClearField("token")
    with pytest.raises(RankMessageError, match=r"^rank 0 sent a RankBroadcast without its open\.agents\[1\]\.token$"):
        decode(pb.RankBroadcast, message.SerializeToString(), "rank 0")
    with pytest.raises(RankMessageError, match="^rank 0 sent a RankBroadcast without a kind$"):
        decode(pb.RankBroadcast, b"", "rank 0")


def test_a_field_this_version_does_not_know_is_refused_naming_its_number():
    unknown = UPLOAD.SerializeToString() + b"\x48\x01"  # field 9, varint 1
    with pytest.raises(RankMessageError, match="^aggregator rank 2 sent a RankUpload with field number 9, which this "
                                               "fedpar does not know"):
        decode(pb.RankUpload, unknown, "aggregator rank 2")
    inner = pb.RankBroadcast(close=pb.RankClose.FromString(encode(BROADCASTS["close"].close) + b"\x48\x01"))
    with pytest.raises(RankMessageError, match="RankBroadcast with field number 9 in close, which"):
        decode(pb.RankBroadcast, inner.SerializeToString(), "rank 0")


class Recorded:
    """Rank 0's answers for the test: it keeps what each call brought; a Count naming agent "late" is refused."""

    def __init__(self):
        self.calls: list[tuple[str, int, object]] = []

    def count(self, rank, uploads):
        if any(upload.agent_id == "late" for upload in uploads.uploads):
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "round 3 is closed")
        self.calls.append(("count", rank, uploads))

    def reject(self, rank, rejection):
        self.calls.append(("reject", rank, rejection))

    def downloaded(self, rank, download):
        self.calls.append(("downloaded", rank, download))

    async def alive(self, rank, alive):
        self.calls.append(("alive", rank, alive))


def test_rank_0s_service_takes_typed_calls_and_refuses_malformed_ones_naming_the_rank():
    async def scenario():
        recorded = Recorded()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((control_handler("s3cret", 3, recorded),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        target = f"127.0.0.1:{port}"
        client = RankControlClient(target, "s3cret", 2, timeout_seconds=10)
        try:
            for name, message in CALLS.items():
                await client.call(name, message)
            assert [(what, rank, message) for what, rank, message in recorded.calls] == [
                ("count", 2, CALLS["Count"]), ("reject", 2, CALLS["Reject"]),
                ("downloaded", 2, CALLS["Downloaded"]), ("alive", 2, CALLS["Alive"])]
            late = pb.RankUpload()
            late.CopyFrom(UPLOAD)
            late.agent_id = "late"
            with pytest.raises(Refusal, match="round 3 is closed"):
                await client.call("Count", pb.RankUploads(uploads=[UPLOAD, late], count=2))
            with pytest.raises(TypeError, match="RankControl.Count takes a RankUploads, not RankDownload"):
                await client.call("Count", CALLS["Downloaded"])

            async with grpc.aio.insecure_channel(target) as channel:
                async def raw(data: bytes, rank: str = "2", secret: str = "s3cret") -> grpc.aio.AioRpcError:
                    rpc = channel.unary_unary(f"/{SERVICE.full_name}/Count")
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await rpc(data, metadata=((SECRET_HEADER, secret), (RANK_HEADER, rank)), timeout=10)
                    return err.value
                cut = COUNT.SerializeToString()[:-3]  # into the upload: its count (the last field) is gone too
                err = await raw(cut)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.details().startswith(f"aggregator rank 2 sent {len(cut)} bytes that are not a RankUploads")
                err = await raw(COUNT.SerializeToString()[:-2])  # cut at the upload's end: no count
                assert err.details() == "aggregator rank 2 sent a RankUploads without its count"
                err = await raw(pb.RankUploads(uploads=[pb.RankUpload(agent_id="abc")], count=1).SerializeToString())
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.details() == "aggregator rank 2 sent a RankUploads without its uploads[0].round"
                err = await raw(COUNT.SerializeToString(), rank="3")
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.details() == "a RankControl call named '3' as its aggregator rank, not one of 1..2"
                err = await raw(COUNT.SerializeToString(), secret="guess")
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            assert len(recorded.calls) == 4  # nothing malformed reached rank 0's round
        finally:
            await client.close()
            await server.stop(0)
    asyncio.run(scenario())


def test_with_the_coordinators_certificates_the_control_channel_speaks_only_tls():
    certs = temporary_cert_dir([])
    files = server_tls_files(certs.name)

    async def scenario():
        recorded = Recorded()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((control_handler("s3cret", 3, recorded),))
        port = add_control_port(server, "127.0.0.1", files)
        await server.start()
        target = f"127.0.0.1:{port}"
        # The address the group reaches rank 0 at need not be in its certificate: the rank checks the certificate's
        # name and its CA.
        secure = RankControlClient(target, "s3cret", 1, timeout_seconds=10, tls=files)
        plain = RankControlClient(target, "s3cret", 1, timeout_seconds=2)
        try:
            await secure.call("Alive", CALLS["Alive"])
            assert recorded.calls == [("alive", 1, CALLS["Alive"])]
            with pytest.raises(Refusal, match="did not answer"):  # plaintext (the secret in clear) is not heard
                await plain.call("Alive", CALLS["Alive"])
            assert len(recorded.calls) == 1
        finally:
            await secure.close()
            await plain.close()
            await server.stop(0)
    try:
        asyncio.run(scenario())
    finally:
        certs.cleanup()


def test_a_plaintext_control_channel_other_hosts_reach_is_said_once_at_start_up():
    assert plaintext_warning("127.0.0.1") is None and plaintext_warning("localhost") is None
    line = plaintext_warning("10.1.2.3")
    assert line == ("aggregator ranks: rank 0's control channel on 10.1.2.3 is PLAINTEXT: its secret and every count "
                    "travel unencrypted; give the coordinator certificates (--certs) when the ranks run on several "
                    "hosts")
