"""Round modes at the agent: what a task's settings make the agent do around training, and how its update goes up.

Every mode has the same small interface, which the agent (client/agent.py) uses for each task:
  begin()     when the task arrives, before training; False if the task is over already (refusal noted)
  upload(trained, global_weights, result, metrics)   make the update and send it; True if it was accepted
  close()     after an accepted upload: what the round still needs from the agent (secure: unmasking)
PlainUpload sends the new weights, CompressedUpload their delta encoded as the task asks (both through the
agent's transport, after client-side DP when the task asks for it), and SecureUpload a masked vector inside
the SecAgg+ stages.

Client-side differential privacy (:func:`privatize_update`) clips this agent's update (and optionally adds local
noise) before upload. The coordinator asks for it through the task's settings: ``dp_clip_norm`` (whole-model L2
bound ``C`` on ``new - global``) and ``dp_local_noise`` (local noise multiplier ``s``: each coordinate of the
clipped update gets ``N(0, (s C)^2)``, i.e. local DP, with fresh OS entropy). The central noise is added by the
coordinator, which also checks that the update really is within ``C``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Callable

import grpc
import numpy as np

from fedpar.aggregation.clipping import clip_update
from fedpar.client.compressed import PreparedUpload, UpdateCompressor
from fedpar.client.local_loop import TrainResult
from fedpar.client.secure_upload import SecureSession, flat_update
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.task_settings import TaskSettings
from fedpar.secagg.errors import SecAggAbort, SecAggError
from fedpar.task import upload_timeout

Send = Callable[[PreparedUpload, TrainResult, dict[str, float]], bool]  # the agent's transport: True if accepted
NoteRefusal = Callable[[str, Exception], None]  # (what was refused, why)


def dp_settings(settings: TaskSettings | Mapping) -> tuple[float, float] | None:
    """``(clip_norm, local_noise_multiplier)`` requested by the task, or None when it asks for no clipping."""
    settings = TaskSettings.of(settings)
    if settings.dp_clip_norm is None:
        return None
    return settings.dp_clip_norm, settings.dp_local_noise or 0.0


def privatize_update(new_weights: Sequence[np.ndarray], global_weights: Sequence[np.ndarray],
                     dp: tuple[float, float] | None, rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """The weights to upload: ``new_weights`` with its delta from ``global_weights`` clipped (and noised) as ``dp``
    (:func:`dp_settings`) says."""
    if dp is None:
        return list(new_weights)
    clip, local_noise = dp
    clipped, _ = clip_update(new_weights, global_weights, clip)
    if local_noise > 0:
        rng = rng or np.random.default_rng()
        std = local_noise * clip
        clipped = [(w + std * rng.standard_normal(w.shape)).astype(w.dtype) for w in clipped]
    return clipped


class PlainUpload:
    """Plain rounds: the new weights go up in the clear (clipped, maybe noised, if the task asks for client DP)."""

    def __init__(self, settings: TaskSettings, layout: ModelLayout, send: Send, note_refusal: NoteRefusal):
        self.settings = settings
        self.dp = dp_settings(settings)  # client-side DP: (clip norm, local noise), or None
        self.layout = layout
        self.send = send
        self.note_refusal = note_refusal

    def begin(self) -> bool:
        """Nothing to do before training."""
        return True

    def upload(self, trained: list[np.ndarray], global_weights: list[np.ndarray], result: TrainResult,
               metrics: dict[str, float]) -> bool:
        """Client-side DP as the task asks, then :meth:`prepare`, then the agent's transport."""
        try:
            prepared = self.prepare(privatize_update(trained, global_weights, self.dp), global_weights)
        except ValueError as err:
            self.note_refusal("preparing the update", err)
            return False
        if self.send(prepared, result, metrics):
            return True
        self.refused()
        return False

    def prepare(self, update: list[np.ndarray], global_weights: list[np.ndarray]) -> PreparedUpload:
        """The tensors to send: the (privatized) new weights themselves."""
        return PreparedUpload(self.layout, list(update))

    def refused(self) -> None:
        """The prepared update was sent but not taken: nothing to undo for plain weights."""

    def close(self) -> None:
        """Nothing more: the coordinator folds the update by itself."""


class CompressedUpload(PlainUpload):
    """Compressed rounds: the delta from the global model, encoded as the task asks, with error feedback."""

    def __init__(self, settings: TaskSettings, layout: ModelLayout, send: Send, note_refusal: NoteRefusal,
                 compressor: UpdateCompressor):
        super().__init__(settings, layout, send, note_refusal)
        self.compressor = compressor

    def prepare(self, update: list[np.ndarray], global_weights: list[np.ndarray]) -> PreparedUpload:
        """The encoded delta (ValueError if it cannot be encoded)."""
        dp = self.dp
        # Without local noise the coordinator verifies the clip norm: compression must stay within it.
        return self.compressor.prepare(self.settings, update, global_weights,
                                       max_norm=dp[0] if dp is not None and dp[1] == 0 else None)

    def refused(self) -> None:
        """The update was not taken: it does not count toward the error-feedback residual."""
        self.compressor.refused()


class SecureUpload:
    """Secure rounds: keys exchanged while training, then a masked vector, then the shares that unmask the sum."""

    REFUSALS = (grpc.RpcError, SecAggError, SecAggAbort)

    def __init__(self, session: SecureSession, layout: ModelLayout, chunk_bytes: int, deadline_at: float,
                 note_refusal: NoteRefusal):
        self.session = session
        self.vector_length = sum(t.numel for t in layout.tensors)
        self.chunk_bytes = chunk_bytes
        self.deadline_at = deadline_at
        self.note_refusal = note_refusal

    def begin(self) -> bool:
        """The key exchange, first, so that it overlaps training rather than following it."""
        try:
            self.session.begin(self.vector_length)
        except self.REFUSALS as err:
            self.note_refusal("secure aggregation", err)
            return False
        return True

    def upload(self, trained: list[np.ndarray], global_weights: list[np.ndarray], result: TrainResult,
               metrics: dict[str, float]) -> bool:
        """Mask and send local - global, weighted by the examples seen."""
        try:
            # No metrics in the clear: the coordinator of a secure round learns only the weighted sum.
            self.session.upload_masked(flat_update(trained, global_weights), result.examples, {}, self.chunk_bytes,
                                       timeout=upload_timeout(self.deadline_at))
        except self.REFUSALS as err:
            self.note_refusal("secure aggregation", err)
            return False
        return True

    def close(self) -> None:
        """Wait for the round to close, then send the shares that remove the survivors' masks from the sum."""
        try:
            self.session.unmask()
        except self.REFUSALS as err:
            self.note_refusal("secure aggregation", err)
