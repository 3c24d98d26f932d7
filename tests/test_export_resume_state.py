"""`fedpar export` of a coordinator checkpoint reads its global model only: a damaged state.json or
strategy.safetensors (a resume's state) refused the export of an intact model (QA); a resume still refuses them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedpar.cli.main import main
from fedpar.server.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint

NAMES = ["w", "b"]


def _checkpoint(root):
    weights = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(2, dtype=np.float32)]
    save_checkpoint(root, Checkpoint(4, NAMES, weights, {}, {"sampler": {}}))
    return weights, root / "round-000004"


@pytest.mark.parametrize("damage", ["state.json", "strategy.safetensors"])
def test_a_checkpoint_whose_resume_state_alone_is_damaged_exports_its_model(damage, tmp_path, capsys):
    weights, folder = _checkpoint(tmp_path / "ck")
    (folder / damage).write_bytes(b"{ cut sh")
    with pytest.raises(CheckpointError, match=damage):
        load_checkpoint(tmp_path / "ck")  # a resume refuses it as before
    assert main(["export", str(tmp_path / "ck"), "--to", str(tmp_path / "m.pt")]) == 0
    assert f"from {folder} (round 4), its latest checkpoint\n" in capsys.readouterr().out
    exported = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(exported) == NAMES and all(np.array_equal(t.numpy(), a) for t, a in zip(exported.values(), weights))


def test_a_checkpoint_whose_model_says_another_round_is_refused(tmp_path, capsys):
    _checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "round-000004").rename(tmp_path / "ck" / "round-000005")
    (tmp_path / "ck" / "LATEST").write_text("round-000005\n")
    assert main(["export", str(tmp_path / "ck"), "--to", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert "global.safetensors says round '4', but the directory is for round 5" in err, err
    assert not (tmp_path / "m.pt").exists()
