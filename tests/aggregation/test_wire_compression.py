"""Wire layouts of compressed updates, and bounding the norm of what an encoding decodes to."""

import numpy as np
import pytest

from fedpar.aggregation.compressed_delta import decoded_norm, limit_norm, pack
from fedpar.aggregation.compression import Compressor
from fedpar.protocol.compressed_wire import CompressionConfig, encoded_specs

SPECS = [("w", "float32", (300, 40)), ("b", "float32", (40,)), ("empty", "float32", (0,))]


@pytest.mark.parametrize("method", ["fp16", "bf16", "int8", "topk"])
def test_limit_norm_bounds_the_decoded_delta_and_keeps_the_wire_layout(method):
    config = CompressionConfig(method, topk_ratio=0.05, seed=0)
    rng = np.random.default_rng(0)
    delta = [rng.standard_normal(s).astype(np.float32) for _, _, s in SPECS]
    enc = Compressor(config).encode(delta)
    norm = decoded_norm(enc)
    for bound in (0.5, 0.999 * norm):
        limited = limit_norm(enc, bound)
        assert bound * 0.99 <= decoded_norm(limited) <= bound
        wire = [(a.dtype.name, a.shape) for a in pack(SPECS, limited)]
        assert wire == [(d, s) for _, d, s in encoded_specs(SPECS, config)]
    assert limit_norm(enc, 2 * norm) is enc  # already within the bound: untouched
