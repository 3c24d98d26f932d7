"""EngineTrainer on 2 gloo ranks, all checks in one spawned group: parity with one process under DDP (uneven
last batch), TP (+FedProx) and FSDP, and a deadline every rank obeys together."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.spawn_checks import backend_id, run_checks


CHECKS = Path(__file__).with_name("checks_engine_world2.py")
NAMES = ["check_ddp_minibatches_with_padding_equal_one_process",
         "check_tp_fedprox_full_batch_equals_local_trainer",
         "check_fsdp_deadline_stops_every_rank_together"]
N_TRAIN = 259


# The checks compare against dense references computed on the CPU, so the group is gloo on every machine (even
# one with a GPU per rank); the CUDA paths have their own tests in tests/parallel/test_cuda.py.
@pytest.fixture(scope="module", params=["cpu"], ids=backend_id)
def results(request, tmp_path_factory) -> list[dict]:
    """Each rank's results of every check, from one 2-rank launch."""
    return run_checks(2, CHECKS, NAMES, tmp_path_factory.mktemp("engine_world2"), device=request.param)


def rank0(results: list[dict], name: str) -> dict:
    """The check's result on rank 0, failing with a rank's traceback if one raised."""
    for rank, res in enumerate(results):
        if name not in res:
            pytest.fail(f"{name} did not run on rank {rank} (an earlier check stopped the group)")
        if "error" in res[name]:
            pytest.fail(f"{name} raised on rank {rank}:\n{res[name]['error']}")
    return results[0][name]


def test_ddp_minibatches_with_padding(results):
    r = rank0(results, NAMES[0])
    assert r["max_diff"] < 1e-5
    assert (r["examples"], r["steps"]) == (2 * N_TRAIN, 2 * 4)  # 259 = 3 x 78 + 25: 4 batches per epoch


def test_tp_with_fedprox(results):
    r = rank0(results, NAMES[1])
    assert r["max_diff"] < 1e-5 and r["loss_diff"] < 1e-5
    assert r["examples"] == r["reference_examples"] == 3 * N_TRAIN


def test_deadline_is_obeyed_by_every_rank(results):
    r = rank0(results, NAMES[2])
    assert r["stopped_early"] == 1 and r["steps"] > 0 and r["elapsed"] < 1.5
    assert 0 < r["examples"] <= 10 * r["steps"]  # global batches of 10; padding is never counted
    assert r["late_examples"] == 0 and r["changed"] > 0
    assert results[1][NAMES[2]]["followed"] == 1
