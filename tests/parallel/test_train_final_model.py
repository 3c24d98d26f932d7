"""`fedpar train` of a zoo model keeps its final model as `train --task` does (global.safetensors and global.json,
gathered from the ranks), which `fedpar export` reads; export of the run's DCP checkpoint folder says what to give."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
    build_model("mlp", **info["model"]["model_kwargs"]).load_state_dict(state)  # global.json alone rebuilds it
    capsys.readouterr()
    assert main(["export", str(out / "checkpoints"), "--to", str(tmp_path / "c.pt")]) == 2
    line = capsys.readouterr().err.strip()
    assert "is a `fedpar train` checkpoint directory" in line and f"export the run's --out folder, {out}," in line
    assert "LATEST" not in line


def test_a_2d_layout_trains_and_gathers_its_final_model_without_torch_warnings(tmp_path):
    """--fsdp 2 --tp 2: gathering the model for global.safetensors printed 'While redistributing from
    (_StridedShard(dim=0, sf=2), Shard(dim=0)) to (Replicate(), Replicate()) ... This is suboptimal' on every rank."""
    text, out = tmp_path / "tiny.txt", tmp_path / "run"
    text.write_text("to be or not to be, that is the question. " * 60, encoding="utf-8")
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "fedpar", "train", "--model", "gpt", "--dataset", "text",
                           "--data-path", str(text), "--block-size", "16", "--batch-size", "8", "--eval-batches", "1",
                           "--model-arg", "n_layer=1", "--model-arg", "n_head=2", "--model-arg", "d_model=32",
                           "--nproc", "4", "--fsdp", "2", "--tp", "2", "--device", "cpu", "--max-steps", "1",
                           "--no-plot", "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "redistributing" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    # nor FSDP's 'FSDP2-wrapped module (FSDPGPT) returned a view tensor' on each rank (the TP output's to_local)
    assert "Warning" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert main(["export", str(out), "--to", str(tmp_path / "m.pt")]) == 0
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    vocab = len(set(text.read_text()))
    build_model("gpt", vocab_size=vocab, block_size=16, n_layer=1, n_head=2, d_model=32).load_state_dict(state)
    kwargs = json.loads((out / "global.json").read_text())["model"]["model_kwargs"]  # what the text implied too
    assert kwargs == {"vocab_size": vocab, "block_size": 16, "n_layer": 1, "n_head": 2, "d_model": 32}, kwargs
