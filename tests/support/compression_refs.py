"""The plain reference of a compressed round trip on the receiving side: global + decoded delta."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedpar.aggregation.compression import Compressor, Encoded


def decode_update(compressor: Compressor, enc: Encoded, global_weights: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Server side: ``global + decoded delta``, in the global weights' dtypes."""
    return [(np.asarray(g) + d).astype(np.asarray(g).dtype) for g, d in zip(global_weights, compressor.decode(enc))]
