"""Parallel engine on 4 gloo ranks (2-D meshes): all checks run in ONE spawned process group."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.spawn_checks import backend_id, run_checks


CHECKS = Path(__file__).with_name("checks_world4.py")
NAMES = ["check_fsdp_x_tp_2x2_matches_dense",
         "check_pp_x_fsdp_2x2_matches_dense", "check_hsdp_with_activation_checkpointing_matches_dense",
         "check_grad_clipping_fsdp_x_tp_2x2"]
TOL = 1e-5


# Process start-up dominates (7-18 s per launch when idle); on a 2-core box shared with other jobs a
# launch plus its lazy imports has taken several minutes, so allow more than the suite's 300 s default.
pytestmark = pytest.mark.timeout(900)

# The checks compare against dense references computed on the CPU, so the group is gloo on every machine (even
# one with a GPU per rank); the CUDA paths have their own tests in tests/parallel/test_cuda.py.
@pytest.fixture(scope="module", params=["cpu"], ids=backend_id)
def results(request, tmp_path_factory) -> list[dict]:
    """Each rank's results of every check, from one 4-rank launch."""
    return run_checks(4, CHECKS, NAMES, tmp_path_factory.mktemp("world4"), device=request.param)


def per_rank(results: list[dict], name: str) -> list[dict]:
    """The check's result on every rank, failing with the rank's traceback if it raised."""
    out = []
    for rank, res in enumerate(results):
        if name not in res:
            pytest.fail(f"{name} did not run on rank {rank} (an earlier check stopped the group)")
        if "error" in res[name]:
            pytest.fail(f"{name} raised on rank {rank}:\n{res[name]['error']}")
        out.append(res[name])
    return out


def test_fsdp_x_tp_on_2x2_mesh_matches_dense(results):
    rs = per_rank(results, "check_fsdp_x_tp_2x2_matches_dense")
    for r in rs:
        assert r["max_loss_diff"] < TOL and r["max_param_diff"] < TOL
        assert r["local_share"] == pytest.approx(0.25, abs=0.03)  # 1/4 of the model per rank
        assert len(r["placements"]) == 2  # parameters are DTensors on the 2-D (fsdp, tp) mesh
    assert rs[0]["gathered_diff"] < TOL and [r["gathered"] for r in rs[1:]] == [0, 0, 0]  # the whole model: rank 0


def test_pipeline_x_fsdp_on_2x2_mesh_matches_dense(results):
    rs = per_rank(results, "check_pp_x_fsdp_2x2_matches_dense")
    for r in rs:
        assert r["max_loss_diff"] < TOL and r["max_param_diff"] < TOL
        assert r["local_share"] < 0.3
    assert rs[0]["gathered_diff"] < TOL and [r["gathered"] for r in rs[1:]] == [0, 0, 0]  # the whole model: rank 0


def test_hsdp_with_activation_checkpointing_matches_dense(results):
    for r in per_rank(results, "check_hsdp_with_activation_checkpointing_matches_dense"):
        assert r["max_loss_diff"] < TOL and r["max_param_diff"] < TOL
        assert r["block_type"] == "FSDPCheckpointWrapper"
        assert r["placements"] == ["R", "S(0)"]  # replicated over dp, sharded over fsdp
        assert r["local_share"] == pytest.approx(0.5, abs=0.03)  # sharded over 2 of the 4 ranks


def test_grad_clipping_under_fsdp_x_tp_matches_dense_clip_grad_norm(results):
    rs = per_rank(results, "check_grad_clipping_fsdp_x_tp_2x2")
    for r in rs:
        assert r["norm"] == pytest.approx(r["dense_norm"], rel=1e-5)
        assert r["max_norm"] < r["norm"]  # clipping is active: the step below is the clipped one
        assert r["clipped_norm"] == pytest.approx(r["max_norm"], rel=1e-5)
        assert r["max_param_diff"] < TOL
    # 2-D gradients: row-wise weights, norm weights (replicated over tp), column-wise weights (FSDP strides over TP)
    assert {"(Shard(dim=0), Replicate())", "(Shard(dim=0), Shard(dim=1))",
            "(_StridedShard(dim=0, sf=2), Shard(dim=0))"} <= set(rs[0]["grad_placements"])
