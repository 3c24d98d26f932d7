"""The global weights of one round, serialized once and streamed to every agent that downloads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout, iter_chunks
from fedpar.protocol.messages import layout_to_pb
from fedpar.protocol.rawchunks import encode_data_message


@dataclass(frozen=True)
class WeightPayload:
    """Pre-serialized ModelChunk messages (header first) for one round's global model."""

    round_id: int
    layout: ModelLayout
    messages: tuple[bytes, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (without framing)."""
        return self.layout.total_bytes


def build_payload(round_id: int, layout: ModelLayout, arrays: Sequence[np.ndarray], chunk_bytes: int) -> WeightPayload:
    """Serialize ``arrays`` into header + data ModelChunk messages of at most ``chunk_bytes`` of data."""
    header = pb.ModelChunk(header=pb.ModelHeader(round=round_id, tensors=layout_to_pb(layout),
                                                 total_bytes=layout.total_bytes))
    messages = [header.SerializeToString()]
    for offset, data in iter_chunks(arrays, chunk_bytes):
        messages.append(encode_data_message(offset, data))
    return WeightPayload(round_id, layout, tuple(messages))
