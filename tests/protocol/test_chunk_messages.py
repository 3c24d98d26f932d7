"""The hand-coded data-chunk encoding is byte-identical to protobuf's and decodes every valid form."""

import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import RawData, decode_chunk_message, encode_data_message, entries_within


@pytest.mark.parametrize("offset", [0, 1, 127, 128, 300, 2**35 + 5])
@pytest.mark.parametrize("size", [1, 127, 128, 70_000])
def test_encoding_matches_protobuf_for_both_stream_messages(offset, size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    raw = encode_data_message(offset, data)
    assert raw == pb.ModelChunk(data=pb.DataChunk(offset=offset, data=data)).SerializeToString()
    assert raw == pb.UploadChunk(data=pb.DataChunk(offset=offset, data=data)).SerializeToString()
    decoded = decode_chunk_message(raw, pb.UploadChunk)
    assert isinstance(decoded, RawData)
    assert decoded.offset == offset and bytes(decoded.data) == data


def test_other_messages_and_non_canonical_forms_use_the_generated_parser():
    header = pb.UploadChunk(header=pb.UploadHeader(round=3)).SerializeToString()
    assert decode_chunk_message(header, pb.UploadChunk).header.round == 3
    # DataChunk with its fields in reverse order: valid protobuf, not the canonical form.
    inner = b"\x12\x03abc" + b"\x08\x07"
    raw = b"\x12" + bytes([len(inner)]) + inner
    parsed = decode_chunk_message(raw, pb.UploadChunk)
    assert not isinstance(parsed, RawData)
    assert (parsed.data.offset, parsed.data.data) == (7, b"abc")


def test_garbage_raises_a_decode_error():
    with pytest.raises(Exception):
        decode_chunk_message(b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", pb.UploadChunk)


@pytest.mark.parametrize("count", [1, 10, 1000])
def test_the_entries_that_fit_a_room_serialize_within_it(count):
    ids = [f"member-{i:07d}" for i in range(5000)]  # 14 bytes each, 20 with the bound's tag and length
    room = count * 20
    fit = entries_within(ids, room)
    assert fit == count and pb.PullHostTasksReply(go=ids[:fit]).ByteSize() <= room
    assert entries_within(ids, 0) == 1 and entries_within([], 100) == 0  # one at least: a message moves on
