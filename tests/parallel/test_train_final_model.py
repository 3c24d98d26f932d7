"""`fedpar train` of a zoo model keeps its final model as `train --task` does (global.safetensors and global.json,
gathered from the ranks), which `fedpar export` reads; export of the run's DCP checkpoint folder says what to give."""

from __future__ import annotations

import json

import torch

from fedpar.cli.main import main
from fedpar.models import build_model
from fedpar.models.for_data import classifier_kwargs


def test_two_ranks_write_the_final_model_and_export_reads_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--model", "mlp", "--dataset", "digits", "--max-steps", "3", "--nproc", "2",
                 "--dp-replicate", "2", "--device", "cpu", "--checkpoint-every", "3", "--no-plot",
                 "--out", str(out)]) == 0
    info = json.loads((out / "global.json").read_text())
    assert info["model"]["model"] == "mlp" and info["metrics"]["step"] == 3
    assert main(["export", str(out), "--to", str(tmp_path / "m.pt")]) == 0
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    build_model("mlp", **classifier_kwargs("mlp", (1, 8, 8), 10)).load_state_dict(state)  # whole, plain names
    capsys.readouterr()
    assert main(["export", str(out / "checkpoints"), "--to", str(tmp_path / "c.pt")]) == 2
    line = capsys.readouterr().err.strip()
    assert "is a `fedpar train` checkpoint directory" in line and f"export the run's --out folder, {out}," in line
    assert "LATEST" not in line
