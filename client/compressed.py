"""The agent's side of update compression: encode each round's delta as the task asks, with error feedback."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from fedpar.aggregation.compressed_delta import limit_norm, pack
from fedpar.aggregation.compression import Compressor, encode_update
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.compressed_wire import config_from_settings, encoded_specs, header_fields
from fedpar.protocol.task_settings import TaskSettings


@dataclass
class PreparedUpload:
    """The tensors an agent uploads and how they are encoded ("" = the new weights themselves)."""

    layout: ModelLayout
    arrays: list[np.ndarray]
    encoding: str = ""
    encoding_json: str = ""


class UpdateCompressor:
    """Encodes an agent's updates as its tasks ask; keeps the error-feedback residual from round to round."""

    def __init__(self, model_layout: ModelLayout, seed: int | None = None):
        """Nothing encoded yet; ``seed`` seeds int8's stochastic rounding (None: fresh entropy)."""
        self.model_layout = model_layout
        self.seed = seed
        self.compressor: Compressor | None = None
        self._undo: tuple[Compressor, list[np.ndarray] | None] | None = None  # residual before the last update

    def prepare(self, settings: TaskSettings | Mapping, new_weights: Sequence[np.ndarray],
                global_weights: Sequence[np.ndarray], max_norm: float | None = None) -> PreparedUpload:
        """The upload for this round: the new weights, or their delta from the global compressed as asked.

        ``max_norm`` (e.g. a client-side DP clip norm the coordinator verifies) bounds the L2 norm of the
        delta the upload decodes to; what scaling removes is dropped, not fed back into the residual.
        Raises ValueError if the task asks for an unknown compression or the delta is not finite.
        """
        self._undo = None
        config = config_from_settings(TaskSettings.of(settings))
        if config.method == "none":
            return PreparedUpload(self.model_layout, list(new_weights))
        config = replace(config, seed=self.seed)
        if self.compressor is None or self.compressor.config != config:
            self.compressor = Compressor(config)  # new settings: the residual starts from zero
        previous = self.compressor.residual("")
        try:
            encoded = encode_update(self.compressor, new_weights, global_weights)
            if max_norm is not None:
                encoded = limit_norm(encoded, max_norm)
        except ValueError:
            self.compressor.restore_residual("", previous)
            raise
        self._undo = (self.compressor, previous)
        specs = self.model_layout.specs()
        return PreparedUpload(ModelLayout(encoded_specs(specs, config)), pack(specs, encoded),
                              *header_fields(config))

    def take_residual(self) -> list[np.ndarray] | None:
        """Remove and return the error-feedback residual (top-k; None when there is none): a simulation host's seat
        hands it back to the virtual client it just trained for."""
        if self.compressor is None:
            return None
        residual = self.compressor.residual("")
        self.compressor.restore_residual("", None)
        self._undo = None
        return residual

    def give_residual(self, settings: TaskSettings | Mapping, residual: list[np.ndarray] | None) -> None:
        """Encode the next update asked with ``settings`` on top of ``residual`` (a virtual client's own, from its
        earlier rounds; None: from zero)."""
        config = replace(config_from_settings(TaskSettings.of(settings)), seed=self.seed)
        if config.method == "none":
            return
        if self.compressor is None or self.compressor.config != config:
            self.compressor = Compressor(config)
        self.compressor.restore_residual("", residual)

    def refused(self) -> None:
        """The last prepared update was not applied: go back to the residual from before it."""
        if self._undo is not None:
            compressor, previous = self._undo
            compressor.restore_residual("", previous)
            self._undo = None
