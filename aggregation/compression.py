"""Client-to-server update compression: fp16/bf16, int8 stochastic quantization, top-k with error feedback.

Compress the update *delta* (new weights - global weights), not the weights: deltas are small and
sparse-friendly. ``encode_update`` does the subtraction around a ``Compressor``; the coordinator adds the decoded
delta back (aggregation/compressed_delta.py). An ``Encoded`` is named numpy arrays plus JSON metadata, so it
travels through the tensor codec without pickle. Error bounds (per element, for finite inputs):
  fp16  |x' - x| <= 2**-11 |x| + 2**-25          (inputs beyond +-65504 are rejected: use bf16)
  bf16  |x' - x| <= 2**-8 |x| + 2**-133
  int8  |x' - x| <= max|x in block| / 127 (x 1+2**-20), and E[x'] = x (stochastic rounding)
  topk  x' + new_residual == x + old_residual, exactly (nothing is lost, only delayed)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedpar.protocol.compressed_wire import CompressionConfig, topk_count
from fedpar.protocol.task_settings import COMPRESSION_METHODS as METHODS

FP16_MAX = 65504.0


@dataclass
class Encoded:
    """A compressed list of arrays: named payload arrays plus JSON-able metadata."""

    method: str
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of payload (what crosses the wire, metadata excluded)."""
        return sum(a.nbytes for a in self.arrays.values())


def _shapes_and_dtypes(arrays: Sequence[np.ndarray]) -> dict[str, Any]:
    """Shapes and dtype names (aggregation/accumulator.ShapesAndDtypes as JSON), for decoding."""
    return {"shapes": [list(a.shape) for a in arrays], "dtypes": [a.dtype.name for a in arrays]}


def _floats(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Inputs as float arrays, rejecting integer or non-finite ones."""
    out = []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if not np.issubdtype(a.dtype, np.floating):
            raise ValueError(f"array {i} has dtype {a.dtype}; only floating-point deltas can be compressed")
        if not np.isfinite(a).all():
            raise ValueError(f"array {i} contains NaN or Inf; fix the update before compressing it")
        out.append(a)
    return out


def encode(arrays: Sequence[np.ndarray], config: CompressionConfig, rng: np.random.Generator | None = None) -> Encoded:
    """Compress ``arrays`` with ``config.method`` (stateless; top-k here has no error feedback: use Compressor)."""
    arrays = _floats(arrays)
    meta = _shapes_and_dtypes(arrays)
    payload: dict[str, np.ndarray] = {}
    m = config.method
    for i, a in enumerate(arrays):
        flat = a.ravel()
        if m == "none":
            payload[f"{i}"] = flat
        elif m == "fp16":
            if flat.size and np.abs(flat).max() > FP16_MAX:
                raise ValueError(f"array {i} has values beyond float16's range (+-65504); use bf16 instead")
            payload[f"{i}"] = flat.astype(np.float16)
        elif m == "bf16":
            import torch  # here, not at import: the strategy catalog (serve's --help) must not pay torch's import

            t = torch.from_numpy(np.ascontiguousarray(flat, np.float32)).to(torch.bfloat16)
            payload[f"{i}"] = t.view(torch.int16).numpy().view(np.uint16)
        elif m == "int8":
            q, scales = quantize_int8(flat, config.int8_block, rng or np.random.default_rng(config.seed))
            payload[f"{i}.q"], payload[f"{i}.scale"] = q, scales
        else:  # topk
            idx, vals = top_k(flat, config.topk_ratio)
            payload[f"{i}.idx"], payload[f"{i}.val"] = idx, vals
    if m == "int8":
        meta["block"] = config.int8_block
    return Encoded(m, payload, meta)


def decode(enc: Encoded) -> list[np.ndarray]:
    """Rebuild the arrays (in their original dtypes and shapes) from an ``Encoded``."""
    if enc.method not in METHODS:
        raise ValueError(f"unknown compression method {enc.method!r}")
    out = []
    for i, (shape, dtype) in enumerate(zip(enc.meta["shapes"], enc.meta["dtypes"])):
        n = math.prod(shape)
        if enc.method in ("none", "fp16"):
            flat = enc.arrays[f"{i}"].astype(dtype)
        elif enc.method == "bf16":
            import torch

            bits = np.ascontiguousarray(enc.arrays[f"{i}"], np.uint16).view(np.int16)
            flat = torch.from_numpy(bits).view(torch.bfloat16).float().numpy().astype(dtype)
        elif enc.method == "int8":
            flat = dequantize_int8(enc.arrays[f"{i}.q"], enc.arrays[f"{i}.scale"], int(enc.meta["block"])).astype(dtype)
        else:
            flat = np.zeros(n, dtype)
            idx = enc.arrays[f"{i}.idx"]
            if idx.size and (idx.min() < 0 or idx.max() >= n):
                raise ValueError(f"top-k indices of array {i} fall outside its {n} elements")
            flat[idx] = enc.arrays[f"{i}.val"]
        if flat.size != n:
            raise ValueError(f"array {i} decodes to {flat.size} values but its shape {shape} needs {n}")
        out.append(flat.reshape(shape))
    return out


def quantize_int8(flat: np.ndarray, block: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per-block scale = max|x|/127 and unbiased stochastic rounding to int8 in [-127, 127]."""
    n = flat.size
    nblocks = -(-n // block)
    padded = np.zeros(nblocks * block, np.float32)
    padded[:n] = flat
    blocks = padded.reshape(nblocks, block)
    scales = (np.abs(blocks).max(axis=1) / 127.0).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
    scaled = blocks / safe[:, None]
    q = np.floor(scaled + rng.random(scaled.shape, dtype=np.float32))
    return np.clip(q, -127, 127).astype(np.int8).ravel()[:n], scales


def dequantize_int8(q: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """Inverse of :func:`quantize_int8` (float32)."""
    n = q.size
    if scales.size != -(-n // block):
        raise ValueError(f"int8 payload has {scales.size} scales for {n} values in blocks of {block}")
    return q.astype(np.float32) * np.repeat(scales, block)[:n]


def top_k(flat: np.ndarray, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Indices (uint32, or int64 past 2**32 entries) and values of the ceil(ratio*n) largest-magnitude entries."""
    n = flat.size
    k = topk_count(n, ratio)
    if k == 0:
        return np.zeros(0, np.uint32), flat[:0].copy()
    idx = np.argpartition(np.abs(flat), n - k)[n - k:] if k < n else np.arange(n)
    idx = np.sort(idx)
    return idx.astype(np.uint32 if n < 2**32 else np.int64), flat[idx].copy()


class Compressor:
    """Encodes per client (top-k keeps each client's error-feedback residual) and counts bytes per round."""

    def __init__(self, config: CompressionConfig | None = None) -> None:
        """Empty residuals and zeroed counters."""
        self.config = config or CompressionConfig()
        self._rng = np.random.default_rng(self.config.seed)
        self._residuals: dict[str, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def encode(self, arrays: Sequence[np.ndarray], client_id: str = "") -> Encoded:
        """Compress one client's delta; with top-k, add that client's residual first and keep the new residual."""
        arrays = _floats(arrays)
        if self.config.method == "topk":
            res = self._residuals.get(client_id)
            if res is not None and [r.shape for r in res] == [a.shape for a in arrays]:
                arrays = [a + r for a, r in zip(arrays, res)]
            enc = encode(arrays, self.config)
            self._residuals[client_id] = [a - d for a, d in zip(arrays, decode(enc))]
        else:
            with self._lock:
                rng = np.random.default_rng(self._rng.integers(2**63))
            enc = encode(arrays, self.config, rng)
        return enc

    def decode(self, enc: Encoded) -> list[np.ndarray]:
        """Rebuild a client's delta."""
        return decode(enc)

    def residual(self, client_id: str) -> list[np.ndarray] | None:
        """The error-feedback residual kept for ``client_id`` (top-k only)."""
        return self._residuals.get(client_id)

    def restore_residual(self, client_id: str, residual: list[np.ndarray] | None) -> None:
        """Put back an earlier residual, e.g. when the update encoded on top of it was never applied."""
        with self._lock:
            if residual is None:
                self._residuals.pop(client_id, None)
            else:
                self._residuals[client_id] = residual


def encode_update(compressor: Compressor, new_weights: Sequence[np.ndarray], global_weights: Sequence[np.ndarray],
                  client_id: str = "") -> Encoded:
    """Client side: compress ``new - global``."""
    return compressor.encode([np.asarray(n) - np.asarray(g) for n, g in zip(new_weights, global_weights)], client_id)

