"""Compressed updates as named wire tensors: the exact layout a run expects, packing, and checked unpacking.

A compressed upload's tensors are the arrays of an :class:`Encoded` delta (new - global), named after the
model tensor they encode, in model order (n = the tensor's element count):
  fp16  NAME float16[n]                     bf16  NAME uint16[n] (bfloat16 bit patterns)
  int8  NAME.q int8[n], NAME.scale float32[ceil(n / int8_block)]
  topk  NAME.idx INDEX[k], NAME.val DTYPE[k]   k = topk_count(n, topk_ratio), DTYPE the tensor's dtype,
        INDEX int32 (int64 for tensors of more than 2**31 elements): 8 bytes per entry sent for float32
The model's (name, dtype, shape) list and the run's CompressionConfig fix this layout completely, so a
receiver knows it before any data arrives. Pure numpy; no gRPC here.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from collections.abc import Sequence

import numpy as np

from fedpar.aggregation.compression import CompressionConfig, Encoded, decode, encode, topk_count
from fedpar.protocol.task_settings import TaskSettings

Spec = tuple[str, str, tuple[int, ...]]
# Suffix of each wire tensor per model tensor; "" keeps the model tensor's own name.
SUFFIXES = {"fp16": ("",), "bf16": ("",), "int8": (".q", ".scale"), "topk": (".idx", ".val")}
FLOAT_DTYPES = ("float16", "float32", "float64")
# Unit roundoff (doubled for margin) of the formats whose values are re-rounded when an encoding is rescaled.
RESCALE_MARGIN = {"fp16": 2.0**-10, "bf16": 2.0**-7, "int8": 2.0**-20, "topk": 2.0**-20}


class EncodedUpdateError(ValueError):
    """A compressed update whose content cannot be a valid encoding of a finite delta."""


def knobs(config: CompressionConfig) -> dict[str, float | int]:
    """The settings of ``config``'s method that shape its wire layout (sent in the upload header)."""
    if config.method == "topk":
        return {"topk_ratio": config.topk_ratio}
    if config.method == "int8":
        return {"int8_block": config.int8_block}
    return {}


def header_fields(config: CompressionConfig) -> tuple[str, str]:
    """(encoding, encoding_json) of an upload compressed with ``config``; ("", "") when uncompressed."""
    if config.method == "none":
        return "", ""
    return config.method, json.dumps(knobs(config), sort_keys=True)


def with_compression(settings: TaskSettings, config: CompressionConfig) -> TaskSettings:
    """``settings`` asking agents to compress with ``config`` (its method and the knobs that shape the layout)."""
    if config.method == "none":
        return settings
    return replace(settings, compression=config.method, **knobs(config))


def config_from_settings(settings: TaskSettings) -> CompressionConfig:
    """The CompressionConfig a task's settings ask for (method "none" when they name none)."""
    d = CompressionConfig()
    return CompressionConfig(method=settings.compression,
                             topk_ratio=d.topk_ratio if settings.topk_ratio is None else settings.topk_ratio,
                             int8_block=d.int8_block if settings.int8_block is None else settings.int8_block)


def encoded_specs(model_specs: Sequence[Spec], config: CompressionConfig) -> list[Spec]:
    """(name, dtype, shape) of every wire tensor of an update of ``model_specs`` compressed with ``config``."""
    if config.method not in SUFFIXES:
        raise ValueError(f"method {config.method!r} has no compressed wire layout")
    out: list[Spec] = []
    for name, dtype, shape in model_specs:
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}; only floating-point models can be compressed")
        n = math.prod(shape)
        if config.method == "fp16":
            out.append((name, "float16", (n,)))
        elif config.method == "bf16":
            out.append((name, "uint16", (n,)))
        elif config.method == "int8":
            out += [(f"{name}.q", "int8", (n,)), (f"{name}.scale", "float32", (-(-n // config.int8_block),))]
        else:
            k = topk_count(n, config.topk_ratio)
            out += [(f"{name}.idx", index_dtype(n), (k,)), (f"{name}.val", dtype, (k,))]
    return out


def index_dtype(n: int) -> str:
    """Wire dtype of top-k indices into a tensor of ``n`` elements."""
    return "int32" if n <= 2**31 else "int64"


def pack(model_specs: Sequence[Spec], enc: Encoded) -> list[np.ndarray]:
    """The wire tensors of ``enc`` in :func:`encoded_specs` order (top-k indices as :func:`index_dtype`)."""
    out = []
    for i, (_, _, shape) in enumerate(model_specs):
        for suffix in SUFFIXES[enc.method]:
            a = enc.arrays[f"{i}{suffix}"]
            out.append(np.ascontiguousarray(a.astype(index_dtype(math.prod(shape))) if suffix == ".idx" else a))
    return out


def unpack_delta(model_specs: Sequence[Spec], config: CompressionConfig,
                 arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Check a received encoding's content and decode it to the delta (model shapes and dtypes, finite).

    ``arrays`` must already have the :func:`encoded_specs` layout (the transport checks that); this checks
    what a layout cannot: index range and uniqueness, int8 range, scales finite and >= 0, finite values.
    Raises EncodedUpdateError naming the tensor at fault.
    """
    suffixes = SUFFIXES[config.method]
    if len(arrays) != len(model_specs) * len(suffixes):
        raise EncodedUpdateError(f"expected {len(model_specs) * len(suffixes)} encoded tensors, got {len(arrays)}")
    payload: dict[str, np.ndarray] = {}
    for i, (name, _, shape) in enumerate(model_specs):
        parts = arrays[i * len(suffixes):(i + 1) * len(suffixes)]
        _check_parts(config.method, name, math.prod(shape), parts)
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


def _check_parts(method: str, name: str, n: int, parts: Sequence[np.ndarray]) -> None:
    if method == "fp16" and not np.isfinite(parts[0]).all():
        raise EncodedUpdateError(f"tensor {name!r}: the float16 delta holds NaN or Inf")
    if method == "int8":
        q, scales = parts
        if q.size and int(q.min()) < -127:
            raise EncodedUpdateError(f"tensor {name!r}: int8 values must lie in [-127, 127]")
        if not np.isfinite(scales).all() or (scales < 0).any():
            raise EncodedUpdateError(f"tensor {name!r}: int8 scales must be finite and >= 0")
    if method == "topk":
        idx, vals = parts
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise EncodedUpdateError(f"tensor {name!r}: top-k indices must lie in [0, {n})")
        if idx.size > 1 and not (idx[1:] > idx[:-1]).all() and np.unique(idx).size != idx.size:
            raise EncodedUpdateError(f"tensor {name!r}: top-k indices must be unique")
        if not np.isfinite(vals).all():
            raise EncodedUpdateError(f"tensor {name!r}: top-k values hold NaN or Inf")


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
