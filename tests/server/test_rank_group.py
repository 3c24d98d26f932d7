"""The aggregator ranks' group on 2 real gloo ranks: every check in one spawned process group
(tests/server/checks_rank_group.py)."""

from __future__ import annotations

from pathlib import Path

from support.spawn_checks import run_checks

CHECKS = Path(__file__).with_name("checks_rank_group.py")


def test_a_models_tensors_reach_every_rank_bit_for_bit_in_buckets(tmp_path):
    results = run_checks(2, CHECKS, ["check_broadcast_arrays_in_buckets"], tmp_path)
    assert [r["check_broadcast_arrays_in_buckets"]["same"] for r in results] == [1.0, 1.0], results
    assert results[1]["check_broadcast_arrays_in_buckets"]["refused"] == 1.0, results


def test_control_messages_of_any_length_reach_every_rank_whole(tmp_path):
    results = run_checks(2, CHECKS, ["check_control_messages_of_any_size"], tmp_path)
    assert [r["check_control_messages_of_any_size"]["same"] for r in results] == [1.0, 1.0], results
    assert results[0]["check_control_messages_of_any_size"]["long"] == 1.0, results


def test_a_rank_that_hangs_after_the_start_costs_the_configured_timeout_not_the_start_ups(tmp_path):
    results = run_checks(2, CHECKS, ["check_a_hung_rank_costs_the_configured_timeout_not_the_start_ups"], tmp_path)
    rank0 = results[0]["check_a_hung_rank_costs_the_configured_timeout_not_the_start_ups"]
    assert rank0["missing"] == 1.0 and rank0["after"] == 1.0, results
    assert 1.5 <= rank0["waited"] < 20, results  # 2 s configured; the group was joined with 60 s
