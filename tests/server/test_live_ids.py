"""The coordinator's live ids (server/member_table.py): a mask with a rank/select index over sorted ids, checked against
a plain sorted set through random away/back sequences, and going away or coming back without a copy of the ids."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from fedpar.server.member_table import LiveIds, RankedMask, id_array
from fedpar.server.members import CohortSampler


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 127, 128, 129, 1000, 4097])
def test_a_ranked_mask_finds_the_same_set_bits_as_a_plain_mask_through_random_flips(size):
    rng = np.random.default_rng(size)
    model = rng.random(size) < 0.5
    mask = RankedMask(model.copy())
    for step in range(60):
        if step == 20:
            positions, flag = np.arange(size), False  # all cleared
        elif step == 21:
            positions, flag = np.array([0, size - 1, 63, 64] if size > 64 else [0, size - 1])[:size], True
        else:
            positions, flag = rng.integers(0, max(size, 1), rng.integers(0, 8) if size else 0), bool(rng.random() < 0.5)
        changed = mask.assign(np.concatenate([positions, positions]), flag)  # each position once, however often named
        assert changed == int((model[np.unique(positions)] != flag).sum())
        model[positions] = flag
        assert mask.count == model.sum()
        np.testing.assert_array_equal(mask.mask(), model)
        np.testing.assert_array_equal(mask.select(np.arange(mask.count)), np.flatnonzero(model))
        np.testing.assert_array_equal(mask.test(np.arange(size)), model)


def test_live_ids_match_a_sorted_set_through_random_away_back_and_joins():
    rng = random.Random(0)
    universe = [f"m{i:04d}" for i in range(0, 600, 2)]  # odd ones join later
    model = {m for m in universe if rng.random() < 0.7}
    live = LiveIds(id_array(universe), np.array([m in model for m in universe]), key=None, valid_until=0.0)
    for step in range(400):
        named = [f"m{rng.randrange(600):04d}" for _ in range(rng.randrange(1, 6))]
        if rng.random() < 0.5:
            live.discard(id_array(named))
            model.difference_update(named)
        else:
            fresh = sorted(set(named) - model)
            live.add(id_array(fresh))
            model.update(fresh)
        if step == 200:
            live.discard(id_array(sorted(model)))  # everyone away
            model.clear()
        expected = sorted(model)
        assert len(live) == len(expected)
        if step % 5 == 0 or not expected:
            assert list(live) == expected and live == expected
        if expected:
            picks = sorted(rng.sample(range(len(expected)), min(10, len(expected))))
            assert live.take(picks) == [expected[i] for i in picks]
            assert (live[0], live[-1], live[len(expected) // 2]) == (expected[0], expected[-1],
                                                                      expected[len(expected) // 2])
            assert expected[-1] in live and live[1:4] == expected[1:4]
        with pytest.raises(IndexError):
            live[len(expected)]
        if step % 50 == 0 and len(expected) > 10:  # the same cohort as drawn from the plain sorted list
            assert CohortSampler(step).sample(live, 10) == CohortSampler(step).sample(expected, 10)
        assert "m9999" not in live and "m0000-wider-than-any" not in live and (named[0] in live) == (named[0] in model)


def test_live_ids_from_nothing_take_joins_and_lose_them_all():
    live = LiveIds(id_array([]), np.zeros(0, bool), key=None, valid_until=0.0)
    assert len(live) == 0 and list(live) == [] and live.take([]) == []
    live.add(id_array(["b", "a-longer-id"]))  # wider than the empty array's ids
    assert len(live) == 2 and list(live) == ["a-longer-id", "b"] and live[1] == "b"
    live.discard(id_array(["b-wider-than-any-held"]))  # not held: nothing changes
    assert list(live) == ["a-longer-id", "b"]
    live.discard(id_array(["a-longer-id", "b", "never-there"]))
    assert len(live) == 0 and list(live) == [] and "b" not in live
    live.add(id_array(["b"]))
    assert list(live) == ["b"]


def test_going_away_and_coming_back_copies_no_array_of_the_population():
    n = 200_000
    ids = np.char.add(b"client-", np.char.zfill(np.arange(n).astype("S7"), 7))
    live = LiveIds(ids, np.ones(n, bool), key=None, valid_until=0.0)
    picked = ids[np.random.default_rng(0).choice(n, 100, replace=False)]
    tracemalloc.start()
    for _ in range(3):
        live.discard(picked)
        assert len(live) == n - 100
        live.add(picked)
        live.take(np.arange(0, n, n // 100))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(live) == n and peak < ids.nbytes // 20, f"{peak} bytes allocated against {ids.nbytes} held"


def test_sorted_unique_is_np_unique_for_runs_in_order_shuffled_ids_and_nothing():
    """sorted_unique (a stable sort, for a host's members joined in chunks) gives what np.unique gives."""
    from fedpar.server.member_table import sorted_unique
    rng = np.random.default_rng(3)
    runs = np.array([f"h{h}-{i:05d}".encode() for h in (1, 0) for i in range(500)] + [b"h0-00007", b"h1-00499"])
    shuffled = rng.permutation(runs)
    for ids in (runs, shuffled, runs[:0], runs[:1]):
        out = sorted_unique(ids)
        assert out.dtype == ids.dtype and out.tolist() == np.unique(ids).tolist()
