"""Compressed rounds: agents upload their delta from the global model, encoded as the run's compression says."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Sequence

import grpc
import numpy as np

from fedpar.aggregation.compression import CompressionConfig
from fedpar.aggregation.wire_compression import (EncodedUpdateError, apply_delta, compression_settings,
                                                 encoded_specs, header_fields, knobs, unpack_delta)
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.task_settings import TaskSettings
from fedpar.server.plain_round import PlainRound, RunUpdate
from fedpar.server.rounds import Refusal

MAX_ENCODING_JSON = 1024


class CompressedRound(PlainRound):
    """Uploads have the exact encoded layout of the run's compression; the update folded is global + decoded delta."""

    known_finite = False  # global + delta may still overflow: the strategy checks what it folds

    def __init__(self, model_layout: ModelLayout, config: CompressionConfig, strategy, run_update: RunUpdate):
        self.config = config
        self.model_specs = model_layout.specs()
        self.encoding, self.encoding_json = header_fields(config)
        super().__init__(ModelLayout(encoded_specs(self.model_specs, config)), strategy, run_update)
        self.described = (f"the {config.method} encoding of the global model this run expects "
                          f"({self.encoding_json})")

    def task_settings(self, settings: TaskSettings) -> TaskSettings:
        """``settings`` plus the compression every agent must use."""
        return replace(settings, **compression_settings(self.config))

    def expected_layout(self, header: pb.UploadHeader) -> tuple[ModelLayout, str]:
        """The encoded layout, if ``header`` names this run's encoding and knobs; else a Refusal."""
        if header.encoding != self.encoding:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"this run takes {self.encoding}-compressed updates ({self.encoding_json}), but the upload "
                          f"is encoded as {header.encoding[:32] or 'none'!r}; compress as the task's extra_json says")
        try:
            if len(header.encoding_json) > MAX_ENCODING_JSON:
                raise ValueError(f"longer than {MAX_ENCODING_JSON} characters")
            sent = json.loads(header.encoding_json or "{}")
        except ValueError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"encoding_json is not valid: {exc}") from None
        if sent != knobs(self.config):
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"encoding_json {header.encoding_json[:200]!r} does not match this run's "
                          f"{self.encoding} settings {self.encoding_json}")
        return self.layout, self.described

    async def decoded(self, global_weights: Sequence[np.ndarray], arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Global + the decoded delta (off the loop for large models); a final Refusal if the content is invalid."""
        return await self.run_update(self._new_weights, global_weights, arrays)

    def _new_weights(self, global_weights: Sequence[np.ndarray], arrays: list[np.ndarray]) -> list[np.ndarray]:
        try:
            return apply_delta(self.model_specs, global_weights, unpack_delta(self.model_specs, self.config, arrays))
        except EncodedUpdateError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{exc}; the update was not applied",
                          final=True) from None
