"""`fedpar simulate --aggregator-ranks 2`: the simulated federation against a two-rank coordinator."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _simulate(out, ranks: int) -> tuple[subprocess.CompletedProcess, list[dict]]:
    result = subprocess.run([sys.executable, "-m", "fedpar", "simulate", "--clients", "6", "--rounds", "3",
                             "--local-epochs", "1", "--aggregator-ranks", str(ranks), "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_simulate_on_two_aggregator_ranks_matches_one_and_shows_the_split(tmp_path):
    _, one = _simulate(tmp_path / "one", 1)
    result, two = _simulate(tmp_path / "two", 2)
    assert "r1_uploads" in result.stdout.splitlines()[0] or "r1_uploads" in result.stdout  # the table's columns
    assert all(r["status"] == "ok" and r["reported"] == 6 for r in two)
    assert all((r["r0_uploads"], r["r1_uploads"]) == (3, 3) for r in two), two
    # The same agents, data and seed: the same models up to the order of float32 sums.
    for a, b in zip(one, two):
        assert abs(a["test_accuracy"] - b["test_accuracy"]) <= 1 / 360, (a, b)  # at most one test image apart
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-4
