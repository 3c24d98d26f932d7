"""The global weights of one round, serialized once and streamed to every agent that downloads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout, as_wire_array, encode_data_message, iter_chunks, wire_bytes
from fedpar.protocol.messages import layout_to_pb


@dataclass(frozen=True)
class WeightPayload:
    """One round's global model, held once: as pre-serialized ModelChunk messages, or (with the data plane)
    as one contiguous buffer that gRPC downloads are chunked from as they stream."""

    round_id: int
    layout: ModelLayout
    chunk_bytes: int
    header_message: bytes  # serialized ModelChunk{header}: the first message of every gRPC download
    model_header: bytes  # serialized ModelHeader (the data plane sends it before the bytes)
    encoded: tuple[bytes, ...] = ()  # pre-serialized data chunks (no data plane)
    flat: memoryview | None = None  # the model's bytes in one contiguous buffer (data plane)
    inline: bytes | None = None  # a small model's bytes, sent inside each TrainTask (no download call)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (without framing)."""
        return self.layout.total_bytes

    def messages(self) -> Iterator[bytes]:
        """The serialized ModelChunk messages of a gRPC download, header first."""
        yield self.header_message
        if self.flat is None:
            yield from self.encoded
            return
        for offset in range(0, len(self.flat), self.chunk_bytes):
            yield encode_data_message(offset, self.flat[offset:offset + self.chunk_bytes])


def build_payload(round_id: int, layout: ModelLayout, arrays: Sequence[np.ndarray], chunk_bytes: int,
                  flat: bool = False, inline_max_bytes: int = 0) -> WeightPayload:
    """Serialize ``arrays`` once: into data ModelChunk messages of at most ``chunk_bytes`` of data, or with
    ``flat`` into one contiguous buffer (which the data plane sends as it is). A model of at most
    ``inline_max_bytes`` also gets its bytes in one piece, to travel inside each task."""
    model_header = pb.ModelHeader(round=round_id, tensors=layout_to_pb(layout), total_bytes=layout.total_bytes)
    header_message = pb.ModelChunk(header=model_header).SerializeToString()
    if not flat:
        encoded = tuple(encode_data_message(offset, data) for offset, data in iter_chunks(arrays, chunk_bytes))
        inline = None
        if layout.total_bytes <= inline_max_bytes:
            inline = wire_bytes(arrays)
        return WeightPayload(round_id, layout, chunk_bytes, header_message, model_header.SerializeToString(),
                             encoded, inline=inline)
    buffer = np.empty(layout.total_bytes, np.uint8)
    for meta, array in zip(layout.tensors, arrays):
        if meta.nbytes:
            buffer[meta.offset:meta.offset + meta.nbytes] = as_wire_array(array).reshape(-1).view(np.uint8)
    return WeightPayload(round_id, layout, chunk_bytes, header_message, model_header.SerializeToString(),
                         flat=memoryview(buffer))
