"""Members' data on demand (datasets/members.py): the same data as before for MNIST and digits, synthetic members
from (seed, member) alone, one shared copy of a partitioned set's examples, and cohorts drawn without a pass over
the population."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
import pytest

from fedpar.datasets import load_dataset
from fedpar.datasets.members import PooledMembers, member_source
from fedpar.server.registry import AgentRegistry
from fedpar.server.members import CohortSampler
from fedpar.datasets.synthetic import client_examples
from fedpar.simulations.population import PopulationMembers, PopulationSlice, client_id
from fedpar.task import Partition
from fedpar.tasks.zoo import classifier_for

SHARED_MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"

# Digests of members' local data (train and validation x, y) and of 5 rounds' cohorts of 100, computed on the code
# before members' data was made on demand: the same seed must keep giving the same data and the same cohorts.
# dirichlet's were computed again when its shares were rounded to whole examples (datasets/rounding.py): the old cut
# short-changed every client but the last of each class by up to one example (tests/datasets/
# test_qa73_data_dirichlet_rounding.py), and again when its pair trades were made to keep each count's expectation.
BEFORE = {
    "digits/iid": ["6b7a4f1fdd18c8fd", "3de28ee83efa9040", "ed1e92cde7f760f9"],
    "digits/dirichlet:0.5": ["02849165e0d05d14", "75fb0329860f4fc6", "a1db23404e6a8ce9"],
    "digits/shards:2": ["f81e6277cdac863d", "963d1d0e3f562fe1", "007397845c11b418"],
    "digits/quantity:1": ["543b69cde6b515ab", "12279cbc02f9be68", "4942d53cce3b5527"],
    "mnist/iid/10000": ["990dd5bf2e42ce96", "99e6300636d5ae19", "8f3956354d550153"],
    "mnist/iid/10000/epc6": ["dab74c2a0754b4f7", "12a6118c3ca959ed"],
    "cohorts/1000": "5bb569ab98e007af",
    "cohorts/20000": "a74cf811982a7071",
}


def _digest(task, k: int, count: int, scheme: str, val_fraction: float = 0.1) -> str:
    data = task.client_data(Partition(k, count, client_id(k), scheme, 0, val_fraction))
    h = hashlib.sha256()
    for part in (data.train, data.val):
        if part is None:
            h.update(b"none")
            continue
        h.update(np.ascontiguousarray(part.x, np.float32).tobytes())
        h.update(np.ascontiguousarray(part.y, np.int64).tobytes())
    return h.hexdigest()[:16]


def test_digits_members_hold_the_same_data_as_before():
    task = classifier_for("mlp", load_dataset("digits"), "digits")
    for scheme in ("iid", "dirichlet:0.5", "shards:2", "quantity:1"):
        assert [_digest(task, k, 20, scheme) for k in (0, 7, 19)] == BEFORE[f"digits/{scheme}"], scheme
    assert [_digest(task, k, 20, "auto") for k in (0, 7, 19)] == BEFORE["digits/iid"]  # auto: iid for digits


@pytest.mark.skipif(not (SHARED_MNIST / "train.npz").exists(), reason="needs ../shared/data/mnist")
def test_mnist_members_hold_the_same_data_as_before_from_one_shared_map():
    splits = load_dataset("mnist", SHARED_MNIST)
    assert isinstance(splits.train.images, np.memmap) and not splits.train.images.flags.writeable
    task = classifier_for("mlp", splits, "mnist")
    assert [_digest(task, k, 10_000, "iid") for k in (0, 1234, 9999)] == BEFORE["mnist/iid/10000"]
    capped = classifier_for("mlp", splits, "mnist", examples_per_client=6)
    assert [_digest(capped, k, 10_000, "iid", 0.0) for k in (0, 9999)] == BEFORE["mnist/iid/10000/epc6"]
    members = member_source(splits, "iid", 10_000, 0)
    assert isinstance(members, PooledMembers) and members.pool is splits.train  # indices over the one copy
    assert members.nbytes < 60_000 * 8 + 10_001 * 16  # 8 bytes an example, 16 a member


def test_cohorts_are_the_same_as_before_and_cost_the_cohort():
    for n in (1000, 20000):
        registry = AgentRegistry(30.0, max_known=n + 10)
        h = None
        for start in range(0, n, 5000):
            h = _join(registry, "host-0", h.token if h else "",
                      [(client_id(i), 5, False) for i in range(start, min(n, start + 5000))])
        sampler, digest = CohortSampler(0), hashlib.sha256()
        for _ in range(5):
            digest.update(",".join(sampler.sample(registry.live_ids(), 100)).encode())
        assert digest.hexdigest()[:16] == BEFORE[f"cohorts/{n}"]
    registry.live_ids()
    started = time.perf_counter()
    for _ in range(200):  # kept, not made again: no pass over the 20,000 members
        sampler.sample(registry.live_ids(), 100)
    assert time.perf_counter() - started < 0.5


def test_live_ids_follow_joins_availability_and_leaves():
    registry = AgentRegistry(30.0)
    h = _join(registry, "h", "", [("m1", 3, False), ("m3", 3, False)])
    assert list(registry.live_ids()) == ["m1", "m3"]
    _join(registry, "h", h.token, [("m2", 3, False), ("m0", 3, True)])
    assert list(registry.live_ids()) == ["m1", "m2", "m3"] and len(registry.live_ids()) == 3
    registry.set_away("h", ["m1"], ["m0"])
    assert list(registry.live_ids()) == ["m0", "m2", "m3"]
    registry.join("agent", 4, {})
    registry.leave("m2")
    assert list(registry.live_ids()) == ["agent", "m0", "m3"] and "m3" in registry.live_ids()


def test_a_million_synthetic_members_cost_their_sizes_until_one_is_read():
    started = time.perf_counter()
    splits = load_dataset("synthetic:1:1:1000000")
    members = splits.members
    assert time.perf_counter() - started < 10 and len(members.sizes) == 1_000_000
    assert len(splits.test) < 2_000 * 60  # the central test set: a bounded sample of members' held-out examples
    again = load_dataset("synthetic:1:1:1000000").members.examples(765_432)
    one = members.examples(765_432)  # from (seed, member) alone: the same in every process, in any order
    np.testing.assert_array_equal(one.x, again.x)
    np.testing.assert_array_equal(one.y, again.y)
    assert len(one) == members.sizes[765_432]
    small = load_dataset("synthetic:1:1:800000").members.examples(765_432)  # a member is itself in any population
    np.testing.assert_array_equal(small.x, one.x)
    assert member_source(splits, "auto", 1_000_000, 0) is members  # auto: the data's own members
    capped = member_source(splits, "natural", 1_000_000, 0, examples_per_client=3)
    assert capped.sizes.max() == 3 and len(capped.examples(765_432)) == min(3, len(one))
    with pytest.raises(ValueError, match="--clients 1000000"):
        member_source(splits, "natural", 10, 0)


def test_mnist_images_are_mapped_from_the_cache_and_kept_in_memory_where_it_cannot_be_written(tmp_path, monkeypatch):
    from fedpar.datasets.mnist import MNIST_TABLE

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (6000, 28, 28), dtype=np.uint8), rng.integers(0, 10, 6000)  # 4.7 MB: shared
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "test.npz", x=x[:10], y=y[:10])
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # no folder can be made there
    kept = load_dataset("mnist", tmp_path)
    assert not isinstance(kept.train.images, np.memmap)
    np.testing.assert_array_equal(kept.train.subset([3]).x[0, 0], MNIST_TABLE[x[3]])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    mapped = load_dataset("mnist", tmp_path)
    assert isinstance(mapped.train.images, np.memmap) and len(list((tmp_path / "cache" / "fedpar").iterdir())) == 1
    np.testing.assert_array_equal(mapped.train.subset([3, 5]).x, kept.train.subset([3, 5]).x)
    np.testing.assert_array_equal(load_dataset("mnist", tmp_path).train.images, x)  # read back from the cache


def test_a_population_too_big_for_the_memory_gets_one_line_before_it_starts(capsys, tmp_path):
    from fedpar.cli.main import main

    # its own --out: the default (runs/simulation under the tests' working folder) may be another test's run's
    code = main(["simulate", "--clients", "10000000000", "--clients-per-round", "100", "--dataset", "synthetic:1:1",
                 "--rounds", "5", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("fedpar simulate: a population of 10,000,000,000 clients") and "GiB of memory" in err


def test_live_ids_kept_up_to_date_match_the_live_agents_counted_anew():
    import random

    rng = random.Random(0)
    registry = AgentRegistry(30.0)
    host = _join(registry, "h", "", [(f"m{i:03d}", 2, False) for i in range(200)])
    away: set[str] = set()
    for step in range(300):
        member = f"m{rng.randrange(260):03d}"
        kind = rng.random()
        if kind < 0.4:
            registry.set_away("h", [member], [])
        elif kind < 0.8:
            registry.set_away("h", [], [member])
        else:
            _join(registry, "h", host.token, [(member, 2, False)])
        if step % 7 == 0:
            live = registry.live_ids()
            away = {a for a in (f"m{i:03d}" for i in range(260)) if registry.get(a) and registry.get(a).away}
            assert list(live) == sorted(a for a in (f"m{i:03d}" for i in range(260))
                                        if registry.get(a) and a not in away)
    assert len(registry.live_ids()) == len(list(registry.live_ids()))


def test_live_ids_outlast_the_liveness_timeout_while_everyone_calls_and_match_a_count_anew_as_calls_lapse():
    import random

    from fedpar.server.registry import AuthError

    rng, now = random.Random(1), [0.0]
    registry = AgentRegistry(10.0, clock=lambda: now[0])
    hosts = {h: _join(registry, h, "", [(f"{h}-m{i}", 3, False) for i in range(40)]).token
             for h in ("h0", "h1")}
    registry.join("a0", 5, {})
    first = registry.live_ids()
    for _ in range(5):  # past the timeout many times over, with every host and agent calling in time
        now[0] += 6.0
        for h, token in hosts.items():
            registry.authenticate_host(h, token)
        registry.authenticate("a0", registry.get("a0").token)
        assert registry.live_ids() is first and len(first) == 81  # kept, not made again
    for step in range(400):  # then hosts and agents call, lapse, leave, go away and join again at random
        now[0] += rng.uniform(0.0, 3.0)
        kind, host = rng.random(), rng.choice(sorted(hosts))
        try:
            if kind < 0.3:
                registry.authenticate_host(host, hosts[host])
            elif kind < 0.45:
                registry.set_away(host, [f"{host}-m{rng.randrange(40)}"], [f"{host}-m{rng.randrange(40)}"])
            elif kind < 0.55:
                hosts[host] = _join(registry, host, hosts[host], [(f"{host}-m{rng.randrange(45)}", 3,
                                                                   rng.random() < 0.3)]).token
            elif kind < 0.7:
                agent = f"a{rng.randrange(4)}"
                record = registry.get(agent)
                registry.authenticate(agent, record.token) if record else registry.join(agent, 5, {})
            elif kind < 0.75:
                registry.leave(f"a{rng.randrange(4)}")
        except AuthError:  # its session lapsed and was forgotten: it joins again
            hosts[host] = _join(registry, host, "", [(f"{host}-m{i}", 3, False) for i in range(40)]).token
        if step % 3 == 0:
            live = registry.live_ids()
            everyone = [f"{h}-m{i}" for h in hosts for i in range(45)] + [f"a{i}" for i in range(4)]
            assert list(live) == sorted(a for a in everyone if registry.get(a) and registry.is_live(registry.get(a)))


def test_a_members_example_count_is_fixed_by_its_first_join_and_a_bad_call_registers_nothing():
    registry = AgentRegistry(30.0)
    h = _join(registry, "h", "", [(f"m{i}", 10 - i, i % 5 == 0) for i in range(7)])
    _join(registry, "h", h.token, [(f"m{i}", 5 + i, False) for i in range(3, 9)])  # counts up for some, down for others
    assert [registry.get(f"m{i}").num_examples for i in range(9)] == [10, 9, 8, 7, 6, 5, 4, 12, 13]
    assert list(registry.live_ids()) == [f"m{i}" for i in range(1, 9)] and len(registry) == 9
    for rows, why in (([("m9", 3, False), ("m\t9", 3, False)], "printable characters, got 'm"),
                      ([("m9", 3, False), ("m9", 2, False)], "'m9' appears twice"),
                      ([("m9", 3, False), ("m10", 0, False)], "num_examples=0 of 'm10'")):
        with pytest.raises(ValueError, match=why):
            _join(registry, "h", h.token, rows)
        assert registry.get("m9") is None and len(registry) == 9  # nothing of a refused call is registered
    other = _join(registry, "g", "", [("g0", 1, False)])
    with pytest.raises(ValueError, match="'m2' is registered already, not by host 'g'"):
        _join(registry, "g", other.token, [("g1", 1, False), ("m2", 1, False)])
    assert registry.get("g1") is None
    with pytest.raises(ValueError, match="is a member of simulation host 'h'"):
        registry.join("m3", 2, {})


def test_100000_members_cost_their_arrays_not_a_record_each():
    import tracemalloc

    registry = AgentRegistry(30.0, max_known=1_000_000)
    ids = [client_id(i) for i in range(100_000)]
    tracemalloc.start()
    h = None
    for start in range(0, len(ids), 10_000):
        chunk = ids[start:start + 10_000]
        h = registry.join_population("host-0", h.token if h else "", "\n".join(chunk), [5] * len(chunk), [])
    live = registry.live_ids()
    assert len(live) == 100_000 and live[0] == "client-0000"
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert registry.members.nbytes / len(ids) < 30  # ids (12 bytes), count, host, away
    # the table and a bit mask over its ids for the live ones: no records, no copy of the ids
    assert held / len(ids) < 35, f"{held / len(ids):.0f} bytes per member"
    record = registry.get("client-12345")
    assert (record.host, record.num_examples, record.away) == ("host-0", 5, False)
    assert registry.authenticate("client-12345", record.token) is not None
    assert registry.get("client-12345\0") is None  # not the member whose id it ends like


def test_a_clients_held_out_examples_are_its_first_and_a_host_tells_its_members_from_its_arrays():
    members = load_dataset("synthetic:1:1:1000").members
    for k in (0, 17, 999):  # the central test sample draws only the held-out rows: the same as the whole client's
        x, y = client_examples(members.spec, k, int(members.all_sizes[k]))
        held = int(members.held[k])
        np.testing.assert_array_equal(members.test_examples(k).x, x[:held])
        np.testing.assert_array_equal(members.examples(k).y, y[held:])
    sizes = np.array([1, 2, 30, 4, 50, 6], np.int64)
    hosted = PopulationMembers(PopulationSlice.of("h", np.array([1, 4, 5]), sizes, np.zeros(6, np.float32)), None,
                               lambda n, member: Partition(n, 6, member, val_fraction=0.1), seed=0)
    hosted.offline[1] = True
    ids, sizes, away = hosted.joining(0, 3)
    assert (ids, sizes.tolist(), away.tolist()) == (["client-0001", "client-0004", "client-0005"], [2, 45, 5],
                                                    [False, True, False])  # less the validation share
    ids, sizes, away = hosted.joining(1, 2)
    assert (ids, sizes.tolist(), away.tolist()) == (["client-0004"], [45], [True])


def _join(registry: AgentRegistry, host: str, token: str, rows: list[tuple[str, int, bool]]):
    """Join ``rows`` (id, examples, away) as members of ``host``, as JoinPopulation carries them."""
    return registry.join_population(host, token, "\n".join(r[0] for r in rows), [r[1] for r in rows],
                                    [i for i, r in enumerate(rows) if r[2]])
