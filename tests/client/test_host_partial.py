"""A host's running sum: members added one by one or stacked (a batched trainer's parameters with a leading member
axis) give the same partial, and a member failing a check is left out of it with the coordinator's reason."""

from __future__ import annotations

import numpy as np
import pytest

from fedpar.client.host_partial import HostSum
from fedpar.protocol.codec import ModelLayout

LAYOUT = ModelLayout([("w", "float32", (3, 2)), ("b", "float32", (2,))])


def test_stacked_members_sum_as_one_by_one_and_a_bad_member_is_left_out():
    rng = np.random.default_rng(0)
    stacked = [rng.normal(size=(4, 3, 2)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)]
    stacked[1][2, 0] = np.nan  # member m2's update is not finite
    members, weights = ["m0", "m1", "m2", "m3"], [5, 7, 3, 11]
    metrics = [{"train_loss": 0.1 * j} for j in range(4)]
    together = HostSum(LAYOUT, 3, ["train_loss"])
    errors = together.add_stacked(members, [f"t{j}" for j in range(4)], stacked, weights, [1] * 4, metrics,
                                  [(20, 1)] * 4)
    assert [e is None for e in errors] == [True, True, False, True] and "'b' contains NaN" in str(errors[2])
    alone = HostSum(LAYOUT, 3, ["train_loss"])
    for j in (0, 1, 3):
        alone.add(members[j], f"t{j}", [x[j] for x in stacked], weights[j], 1, metrics[j], (20, 1))
    with pytest.raises(ValueError, match="num_examples=21 must be in 1..20"):
        alone.add("m4", "t4", [x[0] for x in stacked], 21, 1, {"train_loss": 0.0}, (20, 1))
    a, b = together.message(), alone.message()
    assert a.member_ids == b.member_ids == "m0\nm1\nm3" and list(a.num_examples) == [5, 7, 11]
    assert list(a.metric_values) == pytest.approx([0.0, 0.1, 0.3])
    np.testing.assert_allclose(np.frombuffer(a.data, np.float32), np.frombuffer(b.data, np.float32), rtol=1e-6)
    mean_w = sum(weights[j] * stacked[0][j] for j in (0, 1, 3)) / 23
    np.testing.assert_allclose(np.frombuffer(a.data, np.float32)[:6].reshape(3, 2), mean_w, rtol=1e-5)


def test_a_member_left_out_for_its_report_or_twice_in_a_stack_adds_nothing_not_even_its_nan():
    rng = np.random.default_rng(1)
    stacked = [rng.normal(size=(3, 3, 2)).astype(np.float32), rng.normal(size=(3, 2)).astype(np.float32)]
    stacked[0][1] = np.inf  # m1 also claims too many examples: refused for that, and its Inf must not reach the sum
    partial = HostSum(LAYOUT, 3, [])
    errors = partial.add_stacked(["m0", "m1", "m0"], ["t0", "t1", "t2"], stacked, [4, 99, 6], [1] * 3, [{}] * 3,
                                 [(20, 1)] * 3)
    assert "num_examples=99 must be in 1..20" in str(errors[1]) and "'m0' is in this partial already" in str(errors[2])
    assert errors[0] is None and partial.members == ["m0"]
    np.testing.assert_allclose(np.frombuffer(partial.message().data, np.float32)[:6].reshape(3, 2), stacked[0][0])
    with pytest.raises(ValueError, match=r"tensors have shapes \[\(2, 3\), \(2,\)\], not the model's"):
        partial.add("m3", "t3", [np.zeros((2, 3), np.float32), np.zeros(2, np.float32)], 1, 1, {}, (20, 1))
    assert partial.members == ["m0"]
