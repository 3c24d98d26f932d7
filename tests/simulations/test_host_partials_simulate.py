"""A simulation host's pre-summed partials change nothing it learns: the same seed gives the same model, the same
counted members and the same round metrics with partials (the default for a linear strategy) as with every member's
update sent on its own (FEDPAR_HOST_PARTIALS=0), while the coordinator folds fewer, larger blocks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedpar.cli.main import main
from fedpar.server.final_model import load_final_model

CLIENTS, ROUNDS = 6, 2
ARGS = ["--clients", str(CLIENTS), "--workers", "1", "--seats", "2", "--quiet", "--dataset", "digits", "--model",
        "mlp", "--rounds", str(ROUNDS), "--local-epochs", "1", "--batch-size", "32", "--seed", "5"]


def test_partials_and_per_member_uploads_give_the_same_model_and_rows(tmp_path, monkeypatch):
    for run, partials in (("partials", "1"), ("per-member", "0")):
        monkeypatch.setenv("FEDPAR_HOST_PARTIALS", partials)
        assert main(["simulate", *ARGS, "--out", str(tmp_path / run)]) == 0
    rows = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("partials", "per-member")}
    for got, want in zip(rows["partials"], rows["per-member"]):
        for key in ("round", "status", "sampled", "reported", "examples", "num_updates", "num_examples",
                    "upload_bytes"):
            assert got[key] == want[key], key
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-6)
        assert got["reported"] == CLIENTS
    # one fold per member one by one; a partial folds several members at once (the seats' updates meet in a batch)
    assert sum(r["r0_fold_groups"] for r in rows["partials"]) < CLIENTS * ROUNDS
    for got, want in zip(load_final_model(tmp_path / "partials")[1], load_final_model(tmp_path / "per-member")[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
