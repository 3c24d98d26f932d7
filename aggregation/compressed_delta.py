"""A compressed update's delta between the compression math and the wire: an :class:`Encoded` packed into the
wire tensors of protocol/compressed_wire.py and, on receipt, checked and decoded back, applied to the global
weights, and bounded in norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedpar.aggregation.compression import Encoded, decode, encode
from fedpar.protocol.codec import Spec
from fedpar.protocol.compressed_wire import (SUFFIXES, CompressionConfig, EncodedUpdateError, check_encoded_parts,
                                             index_dtype)

# Unit roundoff (doubled for margin) of the formats whose values are re-rounded when an encoding is rescaled.
RESCALE_MARGIN = {"fp16": 2.0**-10, "bf16": 2.0**-7, "int8": 2.0**-20, "topk": 2.0**-20}


def pack(model_specs: Sequence[Spec], enc: Encoded) -> list[np.ndarray]:
    """The wire tensors of ``enc`` in ``encoded_specs`` order (top-k indices as ``index_dtype``)."""
    out = []
    for i, (_, _, shape) in enumerate(model_specs):
        for suffix in SUFFIXES[enc.method]:
            a = enc.arrays[f"{i}{suffix}"]
            out.append(np.ascontiguousarray(a.astype(index_dtype(math.prod(shape))) if suffix == ".idx" else a))
    return out


def unpack_delta(model_specs: Sequence[Spec], config: CompressionConfig,
                 arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Check a received encoding's content and decode it to the delta (model shapes and dtypes, finite).

    ``arrays`` must already have the ``encoded_specs`` layout (the transport checks that); this checks
    what a layout cannot: index range and uniqueness, int8 range, scales finite and >= 0, finite values.
    Raises EncodedUpdateError naming the tensor at fault.
    """
    suffixes = SUFFIXES[config.method]
    if len(arrays) != len(model_specs) * len(suffixes):
        raise EncodedUpdateError(f"expected {len(model_specs) * len(suffixes)} encoded tensors, got {len(arrays)}")
    payload: dict[str, np.ndarray] = {}
    for i, (name, _, shape) in enumerate(model_specs):
        parts = arrays[i * len(suffixes):(i + 1) * len(suffixes)]
        check_encoded_parts(config.method, name, math.prod(shape), parts)
        payload.update({f"{i}{s}": p for s, p in zip(suffixes, parts)})
    meta = {"shapes": [list(s) for _, _, s in model_specs], "dtypes": [d for _, d, _ in model_specs],
            "block": config.int8_block}
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is caught by the finiteness check below
            delta = decode(Encoded(config.method, payload, meta))
    except ValueError as exc:
        raise EncodedUpdateError(str(exc)) from None
    for (name, _, _), d in zip(model_specs, delta):
        if not np.isfinite(d).all():
            raise EncodedUpdateError(f"tensor {name!r}: the decoded delta holds NaN or Inf")
    return delta


def apply_delta(model_specs: Sequence[Spec], global_weights: Sequence[np.ndarray],
                delta: list[np.ndarray]) -> list[np.ndarray]:
    """``global + delta`` in the global weights' dtypes, reusing ``delta``'s memory; refuses overflow to Inf."""
    out = []
    for (name, _, _), g, d in zip(model_specs, global_weights, delta):
        with np.errstate(over="ignore", invalid="ignore"):
            new = np.add(g, d, out=d) if d.dtype == g.dtype and d.flags.writeable else (g + d).astype(g.dtype)
        if not np.isfinite(new).all():
            raise EncodedUpdateError(f"tensor {name!r}: global + delta overflows to Inf")
        out.append(new)
    return out


def decoded_norm(enc: Encoded) -> float:
    """L2 norm (float64) of the delta ``enc`` decodes to."""
    return math.sqrt(sum(float(np.dot(d.ravel().astype(np.float64), d.ravel().astype(np.float64)))
                         for d in decode(enc)))


def limit_norm(enc: Encoded, max_norm: float) -> Encoded:
    """``enc`` scaled down so that its decoded delta has L2 norm <= ``max_norm`` (as is when it already has).

    int8 and top-k scale their float32 scales / values (exact up to float32 rounding); fp16 and bf16 are
    re-rounded from the scaled decoded delta, shrunk by their unit roundoff so rounding up cannot exceed
    the bound. For a client-side clip norm (differential privacy) that the receiver verifies.
    """
    for _ in range(4):
        norm = decoded_norm(enc)
        if norm <= max_norm:
            return enc
        factor = max_norm / norm / (1 + RESCALE_MARGIN[enc.method])
        if enc.method in ("int8", "topk"):
            suffix = ".scale" if enc.method == "int8" else ".val"
            arrays = {k: (a * factor).astype(a.dtype) if k.endswith(suffix) else a for k, a in enc.arrays.items()}
        else:
            arrays = encode([d * factor for d in decode(enc)], CompressionConfig(method=enc.method)).arrays
        enc = Encoded(enc.method, arrays, enc.meta)
    raise ValueError(f"could not bring the compressed update within L2 norm {max_norm}")
