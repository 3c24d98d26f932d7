"""Arithmetic mod 2^32 for masked vectors, and the fixed-point quantizer that maps weighted updates into it.

Quantization (client side): clip every coordinate of the update x to [-c, c], multiply by the client's
weight w (an integer in 1..W) and by the grid scale s, then round stochastically to an integer (unbiased:
E[q] = w*x*s). The weight itself is appended as one more coordinate, so the unmasked sum holds
sum_i w_i*x_i and sum_i w_i. Each |q| <= W*c*s + 1, and s is chosen as
    s = ((2^31 - 1) // N - 1) / (W * c)
so the sum of up to N clients stays inside the signed int32 range and never wraps mod 2^32.

Error bound: each client's rounding error is < 1 grid step, so the dequantized weighted sum differs from
sum_i w_i*clip(x_i) by less than n/s per coordinate (n = clients in the sum), and the weighted mean by
less than n / (s * sum_i w_i). With weights near W that is about N*c*n / (2^31 * n) ~ N*c / 2^31
(N=50, c=1: 2.3e-8). Clipping is the other, deliberate, deviation from the plain weighted sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedpar.secagg.errors import SecAggAbort, SecAggError

DTYPE = np.dtype("<u4")  # masked vectors: little-endian uint32, arithmetic wraps mod 2^32
INT31_MAX = (1 << 31) - 1
BLOCK = 1 << 16  # quantize in cache-sized blocks: no model-sized float64 temporaries
# The grid step is W*c/(2^31/N): at c = 1e30 one step dwarfs any model, and a coordinate of an update past 1e4 means
# training diverged, so a larger clip only coarsens the sum.
MAX_CLIP = 1e4


def add_into(acc: np.ndarray, other: np.ndarray) -> None:
    """acc += other (mod 2^32), in place."""
    np.add(acc, other, out=acc)


@dataclass(frozen=True)
class Quantizer:
    """Clip, weight and stochastically round updates onto a grid whose N-client sum cannot wrap."""

    clip: float  # c: coordinates are clipped to [-c, c]
    max_weight: int  # W: largest client weight (num_examples is capped here)
    max_clients: int  # N: most clients whose values are summed

    def __post_init__(self):
        if not 0 < self.clip <= MAX_CLIP:
            raise SecAggError(f"clip must be in (0, {MAX_CLIP:g}], got {self.clip}")
        if self.max_weight < 1 or self.max_clients < 1:
            raise SecAggError("max_weight and max_clients must be >= 1")
        if self.max_clients * self.max_weight > INT31_MAX or INT31_MAX // self.max_clients < 2:
            raise SecAggError(f"max_clients x max_weight = {self.max_clients * self.max_weight} does not fit "
                              "the 31-bit sum; lower max_weight")

    @property
    def scale(self) -> float:
        """s: grid points per unit of w*x."""
        return (INT31_MAX // self.max_clients - 1) / (self.max_weight * self.clip)

    def error_bound(self, num_clients: int, weight_sum: int) -> float:
        """Largest possible |dequantized weighted mean - weighted mean of clipped updates| per coordinate."""
        return num_clients / (self.scale * weight_sum)

    def quantize(self, update: np.ndarray, weight: int, rng: np.random.Generator) -> np.ndarray:
        """The field vector [q(w*clip(x)), w] (length len(x)+1, uint32) for one client."""
        weight = int(weight)
        if not 1 <= weight <= self.max_weight:
            raise SecAggError(f"weight {weight} must be in 1..{self.max_weight}")
        x = np.asarray(update).reshape(-1)
        if not np.isfinite(x).all():
            raise SecAggError("the update holds NaN or Inf; refusing to quantize it")
        out = np.empty(x.shape[0] + 1, dtype=DTYPE)
        factor = weight * self.scale
        for start in range(0, x.shape[0], BLOCK):
            v = np.clip(x[start:start + BLOCK].astype(np.float64), -self.clip, self.clip)
            v *= factor
            low = np.floor(v)
            v -= low  # fractional part in [0, 1): round up with that probability
            low += rng.random(v.shape[0]) < v
            out[start:start + v.shape[0]] = low.astype(np.int64).astype(DTYPE)  # negatives wrap mod 2^32
        out[-1] = weight
        return out

    def dequantize_sum(self, total: np.ndarray) -> tuple[np.ndarray, int]:
        """(sum_i w_i*x_i as float64, sum_i w_i) from the unmasked field sum."""
        total = np.asarray(total, dtype=DTYPE)
        weight_sum = int(total[-1])
        if not 0 < weight_sum <= self.max_clients * self.max_weight:
            raise SecAggAbort(f"the unmasked weight sum {weight_sum} is out of range: masks were not removed "
                              "consistently (inconsistent shares or messages)")
        return total[:-1].view(np.int32).astype(np.float64) / self.scale, weight_sum

