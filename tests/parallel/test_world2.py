"""Parallel engine on 2 gloo ranks: every check runs in ONE spawned process group (launch costs ~10 s)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from support.spawn_checks import backend_id, run_checks


CHECKS = Path(__file__).with_name("checks_world2.py")
NAMES = [
    "check_ddp_equals_single_process",
    "check_fsdp_memory_and_numerics",
    "check_tp_mlp_equals_dense",
    "check_tp_attention_blocks_with_sequence_parallel",
    "check_pp_gpipe",
    "check_pp_1f1b",
    "check_pp_interleaved_1f1b",
    "check_full_state_dict_round_trip",
    "check_sampler_uneven_shards",
    "check_uneven_shards_train_without_hanging",
    "check_save_kill_resume_continues_identically",
    "check_grad_accumulation_equals_full_batch",
    "check_gpt_text_tensor_parallel",
    "check_gpt_text_pipeline_checkpoint_resume",
    "check_grad_clipping_fsdp",
    "check_grad_clipping_tp_gpt",
    "check_grad_clipping_tp_mlp",
    "check_grad_clipping_pp",
    "check_tp_sequence_parallel_foreach_momentum_sgd_matches_dense",
    "check_fsdp_grad_accumulation_equals_dense_batch",
    "check_fsdp_bf16_mixed_precision_trains_close_to_fp32_dense",
    "check_interleaved_microbatch_rule_matches_torch",
    "check_trainer_interleaved_1f1b_gpt_matches_dense",
    "check_fused_adamw_on_tp_and_fsdp_matches_dense",
    "check_compiled_gpt_fsdp_matches_eager",
]
TOL = 1e-5


# Process start-up dominates (7-18 s per launch when idle); on a 2-core box shared with other jobs a
# launch plus its lazy imports has taken several minutes, so allow more than the suite's 300 s default.
pytestmark = pytest.mark.timeout(900)

# The checks compare against dense references computed on the CPU, so the group is gloo on every machine (even
# one with a GPU per rank); the CUDA paths have their own tests in tests/parallel/test_cuda.py.
@pytest.fixture(scope="module", params=["cpu"], ids=backend_id)
def results(request, tmp_path_factory) -> list[dict]:
    """Each rank's results of every check, from one 2-rank launch."""
    return run_checks(2, CHECKS, NAMES, tmp_path_factory.mktemp("world2"), device=request.param)


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


def test_ddp_two_ranks_equals_single_process_full_batch(results):
    for r in per_rank(results, "check_ddp_equals_single_process"):
        assert r["max_param_diff"] < TOL


def test_fsdp_stores_half_the_parameters_and_optimizer_state_and_matches(results):
    for r in per_rank(results, "check_fsdp_memory_and_numerics"):
        assert r["param_share"] == pytest.approx(0.5, abs=0.02)
        assert r["optim_state_share"] == pytest.approx(0.5, abs=0.02)
        assert r["max_param_diff"] < TOL


def test_tensor_parallel_mlp_equals_dense(results):
    for r in per_rank(results, "check_tp_mlp_equals_dense"):
        assert r["w1_local_rows"] * 2 == r["w1_rows"]
        assert r["max_loss_diff"] < TOL and r["max_param_diff"] < TOL


def test_tensor_parallel_attention_blocks_with_sequence_parallel_equal_dense(results):
    rs = per_rank(results, "check_tp_attention_blocks_with_sequence_parallel")
    for r in rs:
        assert r["wq_local_share"] == pytest.approx(0.5)
        assert r["max_loss_diff"] < TOL and r["max_param_diff"] < TOL
    assert rs[0]["final_loss"] == rs[1]["final_loss"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_pipeline_gives_unsplit_loss_and_gradients(results, schedule):
    rs = per_rank(results, f"check_pp_{schedule}")
    for r in rs:
        assert r["loss_diff"] < TOL
        assert r["max_grad_diff"] < TOL
    assert sum(r["params_on_rank"] for r in rs) == rs[0]["params_total"]
    assert all(r["params_on_rank"] < r["params_total"] for r in rs)


def test_full_state_dict_gathers_on_rank0_and_broadcasts_back(results):
    rs = per_rank(results, "check_full_state_dict_round_trip")
    assert rs[0]["gathered_keys"] == 6 and rs[1]["gathered_keys"] == 0
    assert rs[0]["gather_diff"] == 0.0
    for r in rs:
        assert r["diff_before_load"] > 0.01 and r["diff_after_load"] == 0.0


def test_sampler_gives_equal_batches_on_uneven_shards(results):
    for r in per_rank(results, "check_sampler_uneven_shards"):
        assert r["batches_per_rank"] == [2, 2]
        assert r["covered"] == 13
        assert r["reshuffled"]


def test_uneven_shards_train_to_the_end_with_exact_evaluation(results):
    for r in per_rank(results, "check_uneven_shards_train_without_hanging"):
        assert r["steps_per_rank"] == [4, 4]  # 13 examples, global batch 8 -> 2 steps per epoch, 2 epochs
        assert r["distributed_accuracy"] == pytest.approx(r["dense_accuracy"], abs=1e-6)


def test_save_kill_resume_continues_identically(results):
    rs = per_rank(results, "check_save_kill_resume_continues_identically")
    for r in rs:
        assert r["resumed_from_step"] == 3 and r["steps"] == 7
        assert r["max_param_diff"] == 0.0
        assert r["accuracy_a"] == r["accuracy_b"]
    assert rs[0]["loss_steps_b"] == list(range(1, 8))  # the crashed run's step-4 line was replaced
    assert rs[0]["max_loss_diff"] == 0.0
    assert len(set(rs[0]["losses_a"])) > 1


def test_gradient_accumulation_equals_the_whole_batch(results):
    for r in per_rank(results, "check_grad_accumulation_equals_full_batch"):
        assert r["max_param_diff"] < TOL


def test_gpt_on_a_text_file_with_tensor_parallel_learns_and_evaluates_like_the_dense_model(results):
    rs = per_rank(results, "check_gpt_text_tensor_parallel")
    for r in rs:
        assert r["vocab"] % 2 == 1  # the embedding and output rows shard unevenly over 2 ranks
        assert math.isfinite(r["val_loss"]) and r["val_loss"] < r["initial_val_loss"] - 0.1
        assert r["val_loss"] == pytest.approx(r["dense_val_loss"], abs=1e-5)
        assert r["precision"] == "fp32"  # the CPU rule
    assert rs[0]["file_val_loss"] == rs[0]["val_loss"]  # summary.json on rank 0


def test_gpt_with_pipeline_parallel_resumes_from_its_multi_part_checkpoint(results):
    rs = per_rank(results, "check_gpt_text_pipeline_checkpoint_resume")
    for r in rs:
        assert math.isfinite(r["val_loss_a"]) and r["val_loss_a"] < r["initial_val_loss"] - 0.1
        assert r["padded_eval"]  # the last validation batch is padded, and padding is not counted
        assert r["val_loss_a"] == pytest.approx(r["dense_val_loss"], abs=1e-5)
        assert r["resumed_from_step"] == 3 and r["steps"] == 7
        assert r["max_param_diff"] == 0.0 and r["val_loss_b"] == r["val_loss_a"]
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(r["checkpoint_files"])  # one part per stage
    assert rs[0]["loss_steps_b"] == list(range(1, 8)) and rs[0]["max_loss_diff"] == 0.0
    assert rs[0]["file_val_loss"] == rs[0]["val_loss_b"]
    assert rs[0]["final_model_diff"] == 0.0  # --pp writes global.safetensors, every stage's tensors in it


@pytest.mark.parametrize("layout", ["fsdp", "tp_gpt", "tp_mlp", "pp"])
def test_grad_clipping_matches_dense_clip_grad_norm(results, layout):
    rs = per_rank(results, f"check_grad_clipping_{layout}")
    for r in rs:
        assert r["norm"] == pytest.approx(r["dense_norm"], rel=1e-5)
        assert r["max_norm"] < r["norm"]  # clipping is active: the step below is the clipped one
        assert r["clipped_norm"] == pytest.approx(r["max_norm"], rel=1e-5)
        assert r["max_param_diff"] < TOL
    if layout == "tp_gpt":
        assert {"(Shard(dim=0),)", "(Shard(dim=1),)", "(Replicate(),)"} <= set(rs[0]["grad_placements"])
    if layout == "tp_mlp":  # DTensor and plain gradients in one norm
        assert {"(Shard(dim=0),)", "plain tensor"} <= set(rs[0]["grad_placements"])
    if layout == "pp":  # each stage alone sees part of the norm; the pp all-reduce makes it whole
        assert all(r["local_norm"] < r["norm"] - 0.01 for r in rs)
        assert math.hypot(*(r["local_norm"] for r in rs)) == pytest.approx(rs[0]["dense_norm"], rel=1e-5)


def test_partial_gradients_of_sequence_parallel_norms_train_like_dense_under_foreach_sgd(results):
    for r in per_rank(results, "check_tp_sequence_parallel_foreach_momentum_sgd_matches_dense"):
        assert "norm.weight" in r["partial_grads"]  # the case the summing is for really occurs
        assert r["max_loss_diff"] < TOL and r["max_param_diff"] < TOL


def test_fsdp_gradient_accumulation_equals_the_dense_whole_batch(results):
    for r in per_rank(results, "check_fsdp_grad_accumulation_equals_dense_batch"):
        assert r["forward_rows"] == [4] * 8  # 4 steps, each 8 rows per rank in 2 forwards
        assert r["max_param_diff"] < TOL and r["max_loss_diff"] < TOL


def test_fsdp_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_masters(results):
    for r in per_rank(results, "check_fsdp_bf16_mixed_precision_trains_close_to_fp32_dense"):
        assert r["precision"] == "bf16"
        assert r["forward_weight_dtypes"] == ["torch.bfloat16"]
        assert r["master_param_dtypes"] == ["torch.float32"] and r["master_params_sharded"]
        assert r["grad_dtypes"] == ["torch.float32"]  # reduce_dtype fp32
        assert r["losses"][-1] < r["losses"][0]
        # bf16 keeps 8 mantissa bits (relative rounding ~4e-3); 4 SGD steps stay within a few of those.
        assert r["max_loss_diff"] < 5e-3
        assert 1e-6 < r["max_param_diff"] < 1e-2  # above 0: the bf16 rounding really happened


def test_config_accepts_exactly_the_interleaved_microbatch_counts_torch_accepts(results):
    for r in per_rank(results, "check_interleaved_microbatch_rule_matches_torch"):
        assert r["config_accepts"] == r["torch_accepts"]
        assert 5 not in r["torch_accepts"] and 6 in r["torch_accepts"]


def test_trainer_with_interleaved_1f1b_matches_the_dense_model(results):
    rs = per_rank(results, "check_trainer_interleaved_1f1b_gpt_matches_dense")
    assert [r["stage_ids"] for r in rs] == [[0, 2], [1, 3]]  # loop layout, 2 stages per rank
    for r in rs:
        assert r["schedule"] == "ScheduleInterleaved1F1B" and r["num_stages"] == 4
        assert min(r["dense_norms"]) > r["max_norm"]  # clipping (over the pp group) is active in both steps
        assert r["max_loss_diff"] < TOL and r["max_param_diff"] < TOL
    assert sum(r["params_on_rank"] for r in rs) == rs[0]["params_total"]


@pytest.mark.parametrize("layout, groups", [("tp", 2), ("fsdp", 1)])
def test_fused_adamw_steps_sharded_parameters_like_dense_adamw(results, layout, groups):
    """TP leaves the last Linear plain: plain tensors and DTensors get one parameter group each."""
    for r in per_rank(results, "check_fused_adamw_on_tp_and_fsdp_matches_dense"):
        r = r[layout]
        assert r["fused"] is True and r["groups"] == groups
        assert r["max_param_diff"] < TOL and r["max_loss_diff"] < TOL


def test_compiled_blocks_under_fsdp_train_like_eager(results):
    for r in per_rank(results, "check_compiled_gpt_fsdp_matches_eager"):
        assert r["graphs_eager"] == 0 and r["graphs_compiled"] > 0
        assert r["max_loss_diff"] < TOL and r["max_param_diff"] < TOL
        assert r["losses"][-1] < r["losses"][0]
