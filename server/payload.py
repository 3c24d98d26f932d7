"""The global weights of one round, serialized once and streamed to every agent that downloads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout, as_wire_array, iter_chunks
from fedpar.protocol.messages import layout_to_pb
from fedpar.protocol.rawchunks import encode_data_message


@dataclass(frozen=True)
class WeightPayload:
    """Pre-serialized ModelChunk messages (header first) for one round's global model."""

    round_id: int
    layout: ModelLayout
    messages: tuple[bytes, ...]
    model_header: bytes = b""  # serialized ModelHeader (the data plane sends it before the bytes)
    flat: memoryview | None = None  # the model's bytes in one contiguous buffer, for the data plane

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (without framing)."""
        return self.layout.total_bytes


def build_payload(round_id: int, layout: ModelLayout, arrays: Sequence[np.ndarray], chunk_bytes: int,
                  flat: bool = False) -> WeightPayload:
    """Serialize ``arrays`` into header + data ModelChunk messages of at most ``chunk_bytes`` of data
    (and, with ``flat``, into one contiguous buffer for the data plane)."""
    model_header = pb.ModelHeader(round=round_id, tensors=layout_to_pb(layout), total_bytes=layout.total_bytes)
    messages = [pb.ModelChunk(header=model_header).SerializeToString()]
    for offset, data in iter_chunks(arrays, chunk_bytes):
        messages.append(encode_data_message(offset, data))
    buffer = None
    if flat:
        buffer = np.empty(layout.total_bytes, np.uint8)
        for meta, array in zip(layout.tensors, arrays):
            if meta.nbytes:
                buffer[meta.offset:meta.offset + meta.nbytes] = as_wire_array(array).reshape(-1).view(np.uint8)
        buffer = memoryview(buffer)
    return WeightPayload(round_id, layout, tuple(messages), model_header.SerializeToString(), buffer)
