"""Assembling a whole chunk list at once: the tests' reference for the codec's streamed receive."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from fedpar.protocol.codec import CodecError, ModelLayout, TensorAssembler


def decode_arrays(layout: ModelLayout, chunks: Iterable[tuple[int, bytes]], max_chunk_bytes: int) -> list[np.ndarray]:
    """Assemble a whole stream of ``(offset, data)`` chunks; raises CodecError if it is incomplete."""
    assembler = TensorAssembler(layout, max_chunk_bytes)
    for offset, data in chunks:
        assembler.write(offset, data)
    if not assembler.complete:
        raise CodecError(f"stream ended after {assembler.received} of {layout.total_bytes} bytes")
    return assembler.arrays
