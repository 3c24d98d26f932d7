"""Client-side differential privacy: clip this agent's update (and optionally add local noise) before upload.

The coordinator asks for it through the task's settings: ``dp_clip_norm`` (whole-model L2 bound ``C``
on ``new - global``) and ``dp_local_noise`` (local noise multiplier ``s``: each coordinate of the clipped
update gets ``N(0, (s C)^2)``, i.e. local DP, with fresh OS entropy). The central noise is added by the
coordinator, which also checks that the update really is within ``C``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedpar.aggregation.clipping import clip_update
from fedpar.protocol.task_settings import TaskSettings


def dp_settings(settings: TaskSettings | Mapping) -> tuple[float, float] | None:
    """``(clip_norm, local_noise_multiplier)`` requested by the task, or None when it asks for no clipping."""
    settings = TaskSettings.of(settings)
    if settings.dp_clip_norm is None:
        return None
    return settings.dp_clip_norm, settings.dp_local_noise or 0.0


def privatize_update(new_weights: Sequence[np.ndarray], global_weights: Sequence[np.ndarray],
                     settings: TaskSettings | Mapping, rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """The weights to upload: ``new_weights`` with its delta from ``global_weights`` clipped (and noised)."""
    dp = dp_settings(settings)
    if dp is None:
        return list(new_weights)
    clip, local_noise = dp
    clipped, _ = clip_update(new_weights, global_weights, clip)
    if local_noise > 0:
        rng = rng or np.random.default_rng()
        std = local_noise * clip
        clipped = [(w + std * rng.standard_normal(w.shape)).astype(w.dtype) for w in clipped]
    return clipped
