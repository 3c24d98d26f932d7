"""L2 clipping of model updates and adaptive clip norms (the math shared by the server and the client).

An update's *delta* is ``new_weights - global_weights`` over the whole model; its norm is one L2 norm over
every array together (flat clipping, as in DP-FedAvg, McMahan et al. 2018).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CHUNK = 1 << 20  # elements per scratch block when a pass needs float64 temporaries


def delta_norm(update: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """Whole-model L2 norm of ``update - reference``, in float64, one chunk at a time (bounded scratch)."""
    if len(update) != len(reference):
        raise ValueError(f"update has {len(update)} arrays but the reference model has {len(reference)}")
    total = 0.0
    for x, y in zip(update, reference):
        x, y = np.ravel(x), np.ravel(y)
        if x.shape != y.shape:
            raise ValueError(f"array of {x.size} elements does not match the reference's {y.size}")
        for s in range(0, x.size, CHUNK):
            d = x[s: s + CHUNK].astype(np.float64) - y[s: s + CHUNK]
            total += float(np.dot(d, d))
    return math.sqrt(total)


def clip_factor(norm: float, clip_norm: float) -> float:
    """The scale ``min(1, C / norm)`` that brings a delta of L2 norm ``norm`` within ``clip_norm``."""
    if not clip_norm > 0:
        raise ValueError(f"clip norm must be > 0, got {clip_norm}")
    return 1.0 if norm <= clip_norm else clip_norm / norm


def clip_update(update: Sequence[np.ndarray], reference: Sequence[np.ndarray],
                clip_norm: float) -> tuple[list[np.ndarray], float]:
    """``reference + min(1, C/||delta||) * delta`` in the update's dtypes, and the delta's norm before clipping."""
    norm = delta_norm(update, reference)
    if not math.isfinite(norm):
        raise ValueError("the update contains NaN or Inf values; it cannot be clipped")
    factor = clip_factor(norm, clip_norm)
    if factor == 1.0:
        return [np.array(u, copy=True) for u in update], norm
    out = []
    for u, r in zip(update, reference):
        u = np.asarray(u)
        d = (u.astype(np.float64) - r) * factor
        out.append((d + r).astype(u.dtype))
    return out, norm


def effective_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """Noise multiplier for the updates when a noisy count shares the budget (Andrew et al. 2021, Thm. 1).

    Releasing the clipped sum with multiplier ``z_delta`` and the unclipped count (sensitivity 1/2 after
    centring) with std ``sigma_b`` is as private as one Gaussian mechanism with multiplier ``z`` when
    ``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``.
    """
    if not noise_multiplier > 0 or not count_noise > 0:
        raise ValueError("noise multiplier and count noise must both be > 0")
    rest = noise_multiplier ** -2 - (2.0 * count_noise) ** -2
    if rest <= 0:
        raise ValueError(f"count noise (--privacy-count-noise) {count_noise:g} is too small for noise multiplier "
                         f"(--privacy-noise) {noise_multiplier:g}: adaptive clipping needs it above "
                         f"{noise_multiplier / 2:g}; raise --privacy-count-noise (e.g. to {noise_multiplier:g}) or "
                         "lower --privacy-noise")
    return rest ** -0.5


@dataclass(frozen=True)
class AdaptiveClipping:
    """Geometric clip-norm update toward a target quantile of update norms (Andrew et al. 2021, Alg. 1).

    ``C <- C * exp(-eta * (b - gamma))`` where ``b`` is the noisy fraction of updates that were *not*
    clipped: ``(sum_k 1[||delta_k|| <= C] + N(0, sigma_b^2)) / expected_clients``.
    """

    target_quantile: float = 0.5  # gamma
    learning_rate: float = 0.2  # eta_C
    count_noise: float = 0.5  # sigma_b, std of the noise on the unclipped count

    def __post_init__(self) -> None:
        """Reject settings that make the update meaningless."""
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"target quantile must be in (0, 1), got {self.target_quantile}")
        if not self.learning_rate > 0:
            raise ValueError(f"clip learning rate must be > 0, got {self.learning_rate}")
        if not self.count_noise > 0:
            raise ValueError(f"count noise must be > 0, got {self.count_noise}")

    def next_clip_norm(self, clip_norm: float, unclipped: int, expected_clients: float,
                       rng: np.random.Generator) -> tuple[float, float]:
        """The next round's clip norm and the noisy unclipped fraction it was computed from."""
        noisy_fraction = (unclipped + rng.normal(0.0, self.count_noise)) / expected_clients
        return clip_norm * math.exp(-self.learning_rate * (noisy_fraction - self.target_quantile)), noisy_fraction
