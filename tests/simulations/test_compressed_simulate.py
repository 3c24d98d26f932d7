"""run_simulation with compressed uploads: real agents compress, the coordinator decodes, the model learns."""

import pytest
import torch

from fedpar.datasets import load_dataset
from fedpar.models import weight_specs
from fedpar.models.for_data import build_model_for_data
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.compressed_wire import CompressionConfig, encoded_specs
from fedpar.simulations.runner import SimulationConfig, run_simulation


def _bytes_per_upload(config: CompressionConfig) -> tuple[int, int]:
    splits = load_dataset("digits")
    specs = weight_specs(build_model_for_data("mlp", splits.input_shape, splits.num_classes))
    return ModelLayout(specs).total_bytes, ModelLayout(encoded_specs(specs, config)).total_bytes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method, ratio, floor", [("int8", 0.01, 0.8), ("topk", 0.05, 0.5)])
def test_compressed_simulation_learns_digits_and_counts_encoded_bytes(method, ratio, floor):
    torch.set_num_threads(1)
    cfg = SimulationConfig(clients=4, rounds=3, local_epochs=2, workers=1,
                           upload_compression=CompressionConfig(method, ratio))
    rows = []
    summary = run_simulation(cfg, on_round=rows.append)
    assert summary["rounds"] == 3 and summary["failed_rounds"] == 0
    assert summary["final_test_accuracy"] > floor  # chance is 0.1
    raw, encoded = _bytes_per_upload(CompressionConfig(method, topk_ratio=ratio))
    assert all(r["upload_bytes"] == r["reported"] * encoded for r in rows)
    assert summary["mean_upload_bytes_per_round"] == 4 * encoded
    assert raw / encoded > (3.9 if method == "int8" else 9.5)
