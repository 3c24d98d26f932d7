"""Compressed updates on the wire: the run's compression settings, the exact tensor layout they fix, the upload
header's encoding fields, and the checks of an encoding's content. Pure numpy; no gRPC here.

A compressed upload's tensors are the arrays of an encoded delta (new - global), named after the model tensor
they encode, in model order (n = the tensor's element count):
  fp16  NAME float16[n]                     bf16  NAME uint16[n] (bfloat16 bit patterns)
  int8  NAME.q int8[n], NAME.scale float32[ceil(n / int8_block)]
  topk  NAME.idx INDEX[k], NAME.val DTYPE[k]   k = topk_count(n, topk_ratio), DTYPE the tensor's dtype,
        INDEX int32 (int64 for tensors of more than 2**31 elements): 8 bytes per entry sent for float32
The model's (name, dtype, shape) list and the run's CompressionConfig fix this layout completely, so a
receiver knows it before any data arrives. The compression math is aggregation/compression.py's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from fedpar.protocol.codec import FLOAT_DTYPES, Spec
from fedpar.protocol.task_settings import COMPRESSION_METHODS, TaskSettings, check_compression
from fedpar.settings import setting

# Suffix of each wire tensor per model tensor; "" keeps the model tensor's own name.
SUFFIXES = {"fp16": ("",), "bf16": ("",), "int8": (".q", ".scale"), "topk": (".idx", ".val")}


COMPRESSION_HELP = (
    "how agents compress the update they upload (the coordinator tells them; agents need no flag). "
    "none: the new float32 weights, exact. "
    "fp16: the delta (new - global) as float16, 2 bytes/parameter, error <= 2^-11 |x| + 2^-25 per element "
    "(deltas beyond +-65504 are not sent: use bf16). "
    "bf16: the delta as bfloat16, 2 bytes/parameter, error <= 2^-8 |x|. "
    "int8: the delta stochastically rounded to int8 with one float32 scale per --int8-block values, "
    "about 1 byte/parameter, error <= max|x in its block| / 127 and unbiased. "
    "topk: only the ceil(ratio x n) largest-magnitude delta entries of each tensor (int32 index + float32 value, "
    "8 bytes each); the rest stays on the agent and is added to its next delta (error feedback): "
    "delayed, never lost")


@dataclass(frozen=True)
class CompressionConfig:
    """Which compression a run uses, and its knobs."""

    method: str = setting("none", flag="compression", key="compression", choices=COMPRESSION_METHODS,
                          group="transfer", help=COMPRESSION_HELP)
    topk_ratio: float = setting(0.01, check="fraction", group="transfer",
                                help="with --compression topk: share of each tensor's entries sent, in (0, 1]; 0.01 "
                                     "sends 1/50 of the float32 bytes")
    int8_block: int = setting(256, check="int8_block", group="transfer",
                              help="with --compression int8: values sharing one float32 scale (smaller: more "
                                   "accurate, 4 more bytes per block)")
    seed: int | None = None  # seed of the stochastic rounding (None: fresh entropy)

    def __post_init__(self) -> None:
        """Reject unknown methods and out-of-range knobs."""
        check_compression(self.method, self.topk_ratio, self.int8_block)


class EncodedUpdateError(ValueError):
    """A compressed update whose content cannot be a valid encoding of a finite delta."""


def topk_count(n: int, ratio: float) -> int:
    """How many of an array's ``n`` entries top-k sends: ceil(ratio * n), at least 1, at most n."""
    return min(n, max(1, math.ceil(ratio * n))) if n else 0


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


def check_encoded_parts(method: str, name: str, n: int, parts: Sequence[np.ndarray]) -> None:
    """Raise EncodedUpdateError unless the wire tensors ``parts`` of model tensor ``name`` (``n`` elements) hold
    a valid ``method`` encoding: what a layout cannot say (index range and uniqueness, int8 range, scales finite
    and >= 0, finite values)."""
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
