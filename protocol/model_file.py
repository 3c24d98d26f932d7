"""The files a run keeps its global model in: ``global.safetensors`` (the tensors, by name) and ``global.json`` (the
round, how to rebuild the model, the round's metrics), in its ``--out`` folder. Every command that keeps a model
(serve, simulate, train) writes them here; server/final_model.py reads them, or a coordinator checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.run_logs import clean_row
from fedpar.protocol.tensorfile import save_tensors

TENSORS = "global.safetensors"  # the state_dict entries, by name
INFO = "global.json"  # the round, how to rebuild the model, the round's metrics
MODEL_KEY = "fedpar.model"  # global.safetensors metadata: the model description as JSON


def write_final_model(out: Path, names: list[str], weights: list[np.ndarray], round_id: int, model: dict,
                      metrics_row: dict | None, interrupted: bool = False) -> bool:
    """Write ``out/global.safetensors`` and ``out/global.json`` for the global model after ``round_id``.

    ``model`` describes how to rebuild the network (e.g. ``{"model": "mlp", "dataset": "digits",
    "input_shape": [1, 8, 8], "num_classes": 10}``). Returns False, writing nothing, when no round has completed.
    """
    if round_id < 1:
        return False
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(out / TENSORS, names, weights, {"round": str(round_id), MODEL_KEY: json.dumps(model)})
    info = {"round": round_id, "interrupted": interrupted, "tensors": TENSORS, "model": model,
            "metrics": clean_row(metrics_row) if metrics_row else None}
    atomic_write_bytes(out / INFO, [(json.dumps(info, indent=2) + "\n").encode()])
    return True
