"""Client-side differential privacy: clip this agent's update (and optionally add local noise) before upload.

The coordinator asks for it through the task's extra config: ``dp_clip_norm`` (whole-model L2 bound ``C``
on ``new - global``) and ``dp_local_noise`` (local noise multiplier ``s``: each coordinate of the clipped
update gets ``N(0, (s C)^2)``, i.e. local DP, with fresh OS entropy). The central noise is added by the
coordinator, which also checks that the update really is within ``C``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedpar.aggregation.clipping import clip_update


def dp_settings(extra: Mapping[str, Any]) -> tuple[float, float] | None:
    """``(clip_norm, local_noise_multiplier)`` requested by the task, or None when it asks for no clipping."""
    if "dp_clip_norm" not in extra:
        return None
    try:
        clip, noise = float(extra["dp_clip_norm"]), float(extra.get("dp_local_noise", 0.0))
    except (TypeError, ValueError):
        raise ValueError(f"task asks for DP with non-numeric settings: dp_clip_norm={extra.get('dp_clip_norm')!r}, "
                         f"dp_local_noise={extra.get('dp_local_noise')!r}") from None
    if not (clip > 0 and math.isfinite(clip)) or not (noise >= 0 and math.isfinite(noise)):
        raise ValueError(f"task asks for DP with dp_clip_norm={clip} (need > 0) and dp_local_noise={noise} "
                         "(need >= 0)")
    return clip, noise


def privatize_update(new_weights: Sequence[np.ndarray], global_weights: Sequence[np.ndarray],
                     extra: Mapping[str, Any], rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """The weights to upload: ``new_weights`` with its delta from ``global_weights`` clipped (and noised)."""
    settings = dp_settings(extra)
    if settings is None:
        return list(new_weights)
    clip, local_noise = settings
    clipped, _ = clip_update(new_weights, global_weights, clip)
    if local_noise > 0:
        rng = rng or np.random.default_rng()
        std = local_noise * clip
        clipped = [(w + std * rng.standard_normal(w.shape)).astype(w.dtype) for w in clipped]
    return clipped
