"""The run's upload format: the exact tensor layout uploads must have, and new weights from compressed ones."""

from __future__ import annotations

import json

import grpc
import numpy as np

from fedpar.aggregation.compression import CompressionConfig
from fedpar.aggregation.wire_compression import (EncodedUpdateError, apply_delta, encoded_specs, header_fields,
                                                 knobs, task_settings, unpack_delta)
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.server.rounds import Refusal

MAX_ENCODING_JSON = 1024


class UploadFormat:
    """What every upload of a run must look like, given the global model's layout and the run's compression."""

    def __init__(self, model_layout: ModelLayout, config: CompressionConfig):
        self.config = config
        self.model_specs = model_layout.specs()
        self.encoding, self.encoding_json = header_fields(config)
        self.compressed = config.method != "none"
        self.layout = ModelLayout(encoded_specs(self.model_specs, config)) if self.compressed else model_layout
        self.described = (f"the {config.method} encoding of the global model this run expects "
                          f"({self.encoding_json})" if self.compressed else "the global model")

    def task_settings(self) -> dict[str, str | float | int]:
        """Keys for every task's extra_json, so agents compress as this run does."""
        return task_settings(self.config)

    def expected_layout(self, header: pb.UploadHeader) -> ModelLayout:
        """The layout ``header``'s tensors must have; a Refusal if it names an encoding this run did not configure."""
        if header.encoding != self.encoding:
            if not self.compressed:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"this run takes uncompressed updates, but the upload is encoded as "
                              f"{header.encoding[:32]!r}; send the new weights with no encoding")
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"this run takes {self.encoding}-compressed updates ({self.encoding_json}), but the upload "
                          f"is encoded as {header.encoding[:32] or 'none'!r}; compress as the task's extra_json says")
        if self.compressed:
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
        return self.layout

    def new_weights(self, global_weights: list[np.ndarray], arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Global + decoded delta of a complete compressed upload; a final Refusal if its content is invalid."""
        try:
            return apply_delta(self.model_specs, global_weights, unpack_delta(self.model_specs, self.config, arrays))
        except EncodedUpdateError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{exc}; the update was not applied",
                          final=True) from None
