"""Every strategy against a closed-form/reference computation, plus the round life cycle and saved state."""

import json
import threading

import numpy as np
import pytest
import torch

from fedpar.aggregation import (FedAdagrad, FedAdam, FedAvg, FedAvgM, FedProx, FedYogi, Krum, Median, MultiKrum,
                                NoUpdatesError, TrimmedMean, build_strategy, proximal_term, strategy_names)
from fedpar.aggregation.fedprox import add_proximal_gradient
from fedpar.aggregation.strategy import Strategy

SHAPES = [(4, 3), (3,), (2, 2, 2)]


def model(rng, scale=1.0, dtype=np.float64):
    return [(scale * rng.standard_normal(s)).astype(dtype) for s in SHAPES]


def cohort(rng, k, global_w, spread=0.1):
    return [([g + spread * rng.standard_normal(g.shape) for g in global_w], int(rng.integers(1, 30))) for _ in range(k)]


def wmean(results):
    w = np.array([n for _, n in results], float)
    return [np.average(np.stack([u[i] for u, _ in results]), axis=0, weights=w) for i in range(len(SHAPES))]


def run_round(strategy, round_id, global_w, results):
    strategy.begin_round(round_id, global_w)
    for j, (u, n) in enumerate(results):
        strategy.fold(u, n, client_id=f"c{j}")
    return strategy.finish()


def assert_models_close(a, b, rtol=1e-10, atol=1e-12):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("cls", [FedAvg, FedProx])
def test_fedavg_and_fedprox_are_the_weighted_mean(cls):
    rng = np.random.default_rng(0)
    g = model(rng)
    results = cohort(rng, 7, g)
    new, metrics = run_round(cls(), 1, g, results)
    assert_models_close(new, wmean(results))
    assert metrics["num_updates"] == 7 and metrics["num_examples"] == sum(n for _, n in results)
    ref_norm = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(new, g)))
    assert metrics["update_norm"] == pytest.approx(ref_norm, rel=1e-12)


def test_fedprox_sends_mu_and_proximal_term_matches_closed_form():
    assert FedProx(proximal_mu=0.25).client_config(3) == {"proximal_mu": 0.25}
    assert FedAvg().client_config(3) == {}
    w = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)]
    g = [torch.tensor([0.0, 1.0]), torch.tensor([[1.0]])]
    term = proximal_term(w, g, mu=0.5)
    assert term.item() == pytest.approx(0.25 * (1 + 1 + 4))
    term.backward()
    np.testing.assert_allclose(w[0].grad.numpy(), 0.5 * np.array([1.0, 1.0]))  # d/dw = mu (w - g)
    np.testing.assert_allclose(w[1].grad.numpy(), 0.5 * np.array([[2.0]]))
    with pytest.raises(ValueError, match="model tensors"):
        proximal_term(w, g[:1], 0.1)


def test_add_proximal_gradient_adds_the_gradient_of_proximal_term():
    w = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)]
    g = [torch.tensor([0.0, 1.0]), torch.tensor([[1.0]])]
    proximal_term(w, g, mu=0.5).backward()
    by_autograd = [p.grad.clone() for p in w]
    for p in w:
        p.grad = torch.zeros_like(p)
    add_proximal_gradient(w, g, mu=0.5)
    for got, want in zip(w, by_autograd):
        torch.testing.assert_close(got.grad, want)


def test_fedavgm_matches_momentum_recurrence():
    rng = np.random.default_rng(1)
    lr, beta = 0.7, 0.5
    s = FedAvgM(server_learning_rate=lr, server_momentum=beta)
    g = model(rng)
    ref_g, v = [x.copy() for x in g], None
    for r in range(1, 4):
        results = cohort(rng, 5, g)
        new, _ = run_round(s, r, g, results)
        grad = [a - b for a, b in zip(ref_g, wmean(results))]
        v = grad if v is None else [beta * m + d for m, d in zip(v, grad)]
        ref_g = [x - lr * m for x, m in zip(ref_g, v)]
        assert_models_close(new, ref_g)
        g = new


def reference_fedopt(kind, rounds, eta, b1, b2, tau, bias=False):
    """Independent closed form of Reddi et al. Algorithm 2 over a list of (global, average) pairs."""
    m = v = None
    outs = []
    for t, (g, avg) in enumerate(rounds, start=1):
        d = [a - x for a, x in zip(avg, g)]
        m = [(1 - b1) * x for x in d] if m is None else [b1 * mm + (1 - b1) * x for mm, x in zip(m, d)]
        if v is None:
            v = [np.zeros_like(x) for x in d]
        if kind == "fedadam":
            v = [b2 * vv + (1 - b2) * x * x for vv, x in zip(v, d)]
        elif kind == "fedyogi":
            v = [vv - (1 - b2) * x * x * np.sign(vv - x * x) for vv, x in zip(v, d)]
        else:
            v = [vv + x * x for vv, x in zip(v, d)]
        lr = eta * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias else eta
        outs.append([x + lr * mm / (np.sqrt(vv) + tau) for x, mm, vv in zip(g, m, v)])
    return outs


@pytest.mark.parametrize("cls,kw,bias", [
    (FedAdam, dict(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3), False),
    (FedAdam, dict(eta=0.05, beta_1=0.8, beta_2=0.9, tau=1e-3), True),
    (FedYogi, dict(eta=0.02, beta_1=0.9, beta_2=0.99, tau=1e-3), False),
    (FedAdagrad, dict(eta=0.1, beta_1=0.0, beta_2=0.0, tau=1e-2), False),
])
def test_fedopt_family_matches_reddi_algorithm_2(cls, kw, bias):
    rng = np.random.default_rng(2)
    s = cls(**kw, bias_correction=bias)
    g = model(rng)
    pairs, outs = [], []
    for r in range(1, 5):
        results = cohort(rng, 6, g, spread=0.3)
        pairs.append((g, wmean(results)))
        g, _ = run_round(s, r, g, results)
        outs.append(g)
    ref = reference_fedopt(cls.name, pairs, kw["eta"], kw["beta_1"], kw["beta_2"], kw["tau"], bias)
    for got, want in zip(outs, ref):
        assert_models_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cls", [FedAdam, FedYogi, FedAvgM])
def test_server_optimizers_step_from_the_unrounded_mean_of_a_float16_model(cls):
    """The mean was cast to float16 before the server step: client changes below float16's step at 1 averaged to
    the global itself, FedAdam's delta was 0 and a third of the coordinates missed their whole step (eta = 0.1).
    Now the step is Reddi et al.'s (or the momentum rule) on the exact mean, to float16's rounding of the result."""
    rng = np.random.default_rng(13)
    g = rng.standard_normal(1000).astype(np.float16)
    results = [([(g + 1e-3 * rng.standard_normal(1000)).astype(np.float16)], n) for n in (1, 2, 3, 4, 5)]
    new, _ = run_round(cls(), 1, [g], results)
    mean = sum(n * u[0].astype(np.float64) for u, n in results) / 15
    if cls is FedAvgM:
        want = mean  # round 1: the momentum is the pseudo-gradient, server learning rate 1
    else:
        s = cls()
        want = reference_fedopt(cls.name, [([g.astype(np.float64)], [mean])], s.eta, s.beta_1, s.beta_2, s.tau)[0][0]
    assert new[0].dtype == np.float16
    np.testing.assert_allclose(new[0], want, rtol=2e-3, atol=2e-3)


def test_fedopt_matches_flower_where_flower_defines_the_same_rule():
    flwr_strategy = pytest.importorskip("flwr.server.strategy")
    from flwr.common import FitRes, Status, Code, ndarrays_to_parameters, parameters_to_ndarrays
    rng = np.random.default_rng(7)
    g0 = model(rng)
    ours = FedYogi(eta=0.03, tau=1e-3)
    theirs = flwr_strategy.FedYogi(initial_parameters=ndarrays_to_parameters(g0), eta=0.03, tau=1e-3)
    g = g0
    for r in range(1, 4):
        results = cohort(rng, 4, g)
        g, _ = run_round(ours, r, g, results)
        fit = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(u), n, {})) for u, n in results]
        params, _ = theirs.aggregate_fit(r, fit, [])
        assert_models_close(g, parameters_to_ndarrays(params), rtol=1e-9)


def test_robust_rules_match_numpy_and_scipy_references():
    from scipy.stats import trim_mean
    rng = np.random.default_rng(3)
    g = model(rng)
    results = cohort(rng, 9, g, spread=1.0)
    stack = [np.stack([u[i] for u, _ in results]) for i in range(len(SHAPES))]
    med, _ = run_round(Median(), 1, g, results)
    assert_models_close(med, [np.median(s, axis=0) for s in stack], rtol=0, atol=0)
    tm, metrics = run_round(TrimmedMean(beta=0.25), 1, g, results)
    assert metrics["trimmed_per_side"] == 2
    assert_models_close(tm, [trim_mean(s, 0.25, axis=0) for s in stack], rtol=1e-12)


def krum_reference(results, f, m):
    flat = [np.concatenate([a.ravel() for a in u]) for u, _ in results]
    n = len(flat)
    d = np.array([[np.sum((a - b) ** 2) for b in flat] for a in flat])
    scores = [np.sort(np.delete(d[i], i))[: max(1, n - f - 2)].sum() for i in range(n)]
    chosen = np.argsort(scores, kind="stable")[:m]
    w = np.array([results[j][1] for j in chosen], float)
    return [sum(wj * results[j][0][i] for j, wj in zip(chosen, w / w.sum())) for i in range(len(SHAPES))], chosen


def test_krum_and_multikrum_match_brute_force_and_reject_outliers():
    rng = np.random.default_rng(4)
    g = model(rng)
    results = cohort(rng, 8, g, spread=0.2)
    for j in (2, 5):  # two far-away attackers
        results[j] = ([x + 50.0 for x in results[j][0]], 1000)
    want, chosen = krum_reference(results, f=2, m=1)
    got, metrics = run_round(Krum(num_malicious=2), 1, g, results)
    assert_models_close(got, want)
    assert metrics["first_selected_index"] == chosen[0] and chosen[0] not in (2, 5)
    want, chosen = krum_reference(results, f=2, m=6)
    got, metrics = run_round(MultiKrum(num_malicious=2), 1, g, results)
    assert metrics["selected"] == 6 and not {2, 5} & set(chosen.tolist())
    assert_models_close(got, want)


@pytest.mark.parametrize("cls,m", [(Krum, 1), (MultiKrum, 3)])
def test_krum_scores_stay_exact_for_a_tight_honest_cluster_and_far_attackers(cls, m):
    """Honest updates 1e-5 apart, attackers 1e5 away: the distances were |a|^2 + |b|^2 - 2 a.b, which cancelled to
    noise (scores off by 10x and more) and Krum picked another honest update than the paper's rule, in 45 of 50
    draws. Now each score is the brute-force one to 1e-9 and the pick is Flower's."""
    aggregate_krum = pytest.importorskip("flwr.server.strategy.aggregate").aggregate_krum
    rng = np.random.default_rng(12)
    base = rng.standard_normal(2000)
    for _ in range(5):
        updates = [base + 1e-5 * (1 + j) * rng.standard_normal(2000) for j in range(7)]
        updates += [base + 1e5 + rng.standard_normal(2000) for _ in range(2)]
        results = [([updates[j]], 1) for j in rng.permutation(9)]
        strategy = cls(num_malicious=2, num_selected=m)
        strategy.begin_round(1, [base])
        for j, (u, n) in enumerate(results):
            strategy.fold(u, n, f"c{j}")
        flat = [u[0] for u, _ in results]
        d = np.array([[np.sum((a - b) ** 2) for b in flat] for a in flat])
        exact = [np.sort(np.delete(d[i], i))[:5].sum() for i in range(9)]
        np.testing.assert_allclose(strategy.scores(), exact, rtol=1e-9)
        got, _ = strategy.finish()
        want = aggregate_krum(results, 2, 0 if m == 1 else m)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=0)


def test_krum_with_too_few_updates_for_its_f_says_so_once(caplog):
    rng = np.random.default_rng(4)
    g = model(rng)
    strategy = Krum(num_malicious=10)
    with caplog.at_level("WARNING", logger="fedpar.aggregation.robust"):
        run_round(strategy, 1, g, cohort(rng, 5, g, spread=0.2))
        run_round(strategy, 2, g, cohort(rng, 5, g, spread=0.2))
    said = [r.getMessage() for r in caplog.records]
    assert said == ["krum: 5 updates in round 1, but its guarantee against f=10 Byzantine updates needs more than "
                    "2f+2=22; lower f (--strategy-option f=...) or raise --clients-per-round"], said


def test_robust_store_keeps_a_copy_and_streaming_keeps_no_reference():
    rng = np.random.default_rng(5)
    g = model(rng)
    results = cohort(rng, 3, g)
    for cls in (FedAvg, Median):
        s = cls()
        s.begin_round(1, g)
        for j, (u, n) in enumerate(results):
            mine = [x.copy() for x in u]
            s.fold(mine, n, f"c{j}")
            for x in mine:
                x.fill(1e6)  # the caller reuses its buffers
        new, _ = s.finish()
        ref = wmean(results) if cls is FedAvg else [np.median(np.stack([u[i] for u, _ in results]), 0) for i in range(3)]
        assert_models_close(new, ref)
    assert "one copy of every update" in Median.memory_note and "one accumulator" in FedAvg.memory_note


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedavg"])
def test_state_dict_resume_continues_identically(name):
    rng = np.random.default_rng(6)
    g = model(rng)
    rounds = []
    for _ in range(4):
        rounds.append(cohort(rng, 4, g, spread=0.2))
    a = build_strategy(name)
    ga = g
    for r in (1, 2):
        ga, _ = run_round(a, r, ga, rounds[r - 1])
    arrays, meta = a.state_dict()
    meta = json.loads(json.dumps(meta))  # JSON-able
    assert meta["strategy"] == name and meta["round"] == 2
    assert all(isinstance(v, np.ndarray) for v in arrays.values())
    b = build_strategy(name)
    b.load_state_dict({k: v.copy() for k, v in arrays.items()}, meta)
    gb = ga
    for r in (3, 4):
        ga, _ = run_round(a, r, ga, rounds[r - 1])
        gb, _ = run_round(b, r, gb, rounds[r - 1])
        assert_models_close(ga, gb, rtol=0, atol=0)
    with pytest.raises(ValueError, match="saved by strategy"):
        build_strategy("median").load_state_dict(arrays, meta)


def test_abort_round_leaves_cross_round_state_unchanged():
    rng = np.random.default_rng(8)
    g = model(rng)
    r1, r2, junk = cohort(rng, 3, g), cohort(rng, 3, g), cohort(rng, 3, g, spread=5.0)
    a, b = FedAdam(eta=0.1, tau=1e-3), FedAdam(eta=0.1, tau=1e-3)
    ga, _ = run_round(a, 1, g, r1)
    gb, _ = run_round(b, 1, g, r1)
    b.begin_round(2, gb)
    for j, (u, n) in enumerate(junk):
        b.fold(u, n, f"j{j}")
    b.abort_round()
    ga, _ = run_round(a, 2, ga, r2)
    gb, _ = run_round(b, 2, gb, r2)
    assert_models_close(ga, gb, rtol=0, atol=0)


def test_life_cycle_errors():
    rng = np.random.default_rng(9)
    g = model(rng, dtype=np.float32)
    for name in strategy_names():
        s = build_strategy(name)
        with pytest.raises(RuntimeError, match="begin_round"):
            s.fold(g, 1)
        s.begin_round(1, g)
        with pytest.raises(NoUpdatesError):
            s.finish()
        with pytest.raises(ValueError, match="shape"):
            s.fold([g[0].T, g[1], g[2]], 1, "x")
        bad = [x.copy() for x in g]
        bad[2][0, 0, 0] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            s.fold(bad, 1, "y")
        s.fold(g, 1, "x")  # the rejected client may retry
        with pytest.raises(ValueError, match="already contributed"):
            s.fold(g, 1, "x")
        new, metrics = s.finish()
        assert [x.dtype for x in new] == [np.float32] * 3 and metrics["num_updates"] == 1
    with pytest.raises(ValueError, match="unknown strategy 'fedsgd'; choose one of: ") as unknown:
        build_strategy("fedsgd")
    assert all(name in str(unknown.value) for name in strategy_names())  # in any order: a new one goes anywhere
    with pytest.raises(ValueError, match="bad options"):
        build_strategy("fedprox", nu=1)  # mu is proximal_mu's alias, as on the command line
    assert build_strategy("Trimmed-Mean").name == "trimmed_mean"


def test_concurrent_folds_into_a_strategy():
    g = [np.zeros(400_000, np.float32)]
    s = FedAvg()
    s.begin_round(1, g)
    ups = [([np.full(400_000, float(i), np.float32)], i + 1) for i in range(16)]
    threads = [threading.Thread(target=s.fold, args=(u, n, f"c{i}")) for i, (u, n) in enumerate(ups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    new, m = s.finish()
    assert m["num_updates"] == 16
    np.testing.assert_allclose(new[0], np.full(400_000, sum(i * (i + 1) for i in range(16)) / sum(range(1, 17))),
                               rtol=1e-6)


def test_returned_global_survives_the_next_round():
    rng = np.random.default_rng(11)
    g = model(rng, dtype=np.float32)
    s = FedAvg()
    results = [([x.astype(np.float32) for x in u], n) for u, n in cohort(rng, 3, g)]
    g1, _ = run_round(s, 1, g, results)
    kept = [x.copy() for x in g1]
    g2, _ = run_round(s, 2, g1, results)
    assert_models_close(g1, kept, rtol=0, atol=0)  # the new round did not write into the previous result


@pytest.mark.parametrize("name", strategy_names())
def test_known_finite_folds_give_the_same_result(name):
    rng = np.random.default_rng(11)
    g = model(rng, dtype=np.float32)
    results = [([x.astype(np.float32) for x in u], n) for u, n in cohort(rng, 6, g)]
    checked, trusted = build_strategy(name), build_strategy(name)
    for s, known in ((checked, False), (trusted, True)):
        s.begin_round(1, g)
        for j, (u, n) in enumerate(results):
            s.fold(u, n, f"c{j}", known_finite=known)
    assert_models_close(checked.finish()[0], trusted.finish()[0], rtol=0, atol=0)


def test_blas_and_pool_finite_checks_agree():
    from fedpar.aggregation import FoldConfig
    from fedpar.aggregation.accumulator import ShapesAndDtypes, WeightedSum, checked_by_blas

    blas_model = [np.ones(3_000_000, np.float32), np.ones(5, np.float64)]
    pool_model = [np.ones(3_000_000, np.float32), np.ones(10, np.float16)]  # float16: numpy sums on the pool
    assert all(checked_by_blas(a) for a in blas_model) and not checked_by_blas(pool_model[1])
    for arrays in (blas_model, pool_model):
        acc = WeightedSum(ShapesAndDtypes.of(arrays), FoldConfig(num_workers=2))
        assert acc.all_finite([arrays, arrays])
        for i in range(len(arrays)):
            for value in (np.inf, -np.inf, np.nan):
                bad = [a.copy() for a in arrays]
                bad[i][-1] = value
                assert not acc.all_finite([arrays, bad])


def fedadam_counting_like_flower(**kw):
    """fedpar's FedAdam with bias correction, its step count started at 1: Flower's FedAdam corrects with
    ``server_round + 1`` (so round 1 is Adam's step 2); the rule is otherwise the same."""
    s = FedAdam(**kw, bias_correction=True)
    s.steps = 1
    return s


@pytest.mark.parametrize("ours,flower,options", [
    (FedAvg, "FedAvg", {}),
    (FedProx, "FedProx", dict(proximal_mu=0.1)),
    (fedadam_counting_like_flower, "FedAdam", dict(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3)),
], ids=["fedavg", "fedprox", "fedadam"])
def test_flower_strategies_run_by_the_adapter_match_fedpars_own(ours, flower, options):
    pytest.importorskip("flwr")
    rng = np.random.default_rng(11)
    g = model(rng)
    mine, theirs = ours(**options), build_strategy(f"flower:flwr.server.strategy:{flower}", **options)
    for r in range(1, 4):
        results = cohort(rng, 5, g, spread=0.3)
        new, metrics = run_round(mine, r, g, results)
        theirs.begin_round(r, g)  # what run_round does, with configure_fit's config asked as the coordinator asks it
        assert theirs.client_config(r) == mine.client_config(r)
        for j, (u, n) in enumerate(results):
            theirs.fold(u, n, client_id=f"c{j}")
        got, their_metrics = theirs.finish()
        assert_models_close(got, new, rtol=1e-9)
        assert their_metrics["num_examples"] == metrics["num_examples"]
        assert their_metrics["num_updates"] == metrics["num_updates"] == 5
        g = new


class _KeepsTheFirst(Strategy):
    """A strategy of the kind docs/contributing.md describes (a Strategy subclass with the five hooks), non-linear."""

    name, linear = "keeps_the_first", False

    def _reset_round(self, shapes):
        self._first, self._count = None, 0

    def _fold(self, update, num_examples, who, known_finite):
        self._first, self._count = self._first or list(update), self._count + 1

    def _num_folded(self):
        return self._count

    def _finish(self, global_weights):
        return self._first, {}

    def _drop_round(self):
        self._first = None


@pytest.mark.parametrize("name", strategy_names())
def test_every_strategy_folds_a_round_split_over_aggregator_ranks(name):
    build_strategy(name).check_ranks(2)  # a partial sum, or its updates handed to rank 0


def test_a_strategy_that_would_lose_another_ranks_updates_is_refused_on_aggregator_ranks_in_one_line():
    """It kept neither a partial sum nor a handoff: rank 1's updates were dropped in silence (4 reported, 2 folded)."""
    strategy = _KeepsTheFirst()
    strategy.check_ranks(1)
    with pytest.raises(ValueError, match=r"^--aggregator-ranks 2 cannot run with --strategy keeps_the_first: it keeps "
                                         r"no partial sum \(partial_sum\) and hands no updates to rank 0 \(handoff\)"):
        strategy.check_ranks(2)


@pytest.mark.parametrize("name", strategy_names())
def test_accumulate_in_sets_a_running_sums_dtype_and_device_and_leaves_a_buffering_strategy_as_it_is(name):
    strategy = build_strategy(name)
    before = strategy.fold_config
    strategy.accumulate_in("float64", "cpu")
    if before is None:  # robust rules buffer updates: no running sum to set
        assert strategy.fold_config is None
    else:
        assert (strategy.fold_config.accumulate_dtype, strategy.fold_config.device) == ("float64", "cpu")
        strategy.accumulate_in(None, None)  # None keeps what it has
        assert (strategy.fold_config.accumulate_dtype, strategy.fold_config.device) == ("float64", "cpu")
        rng = np.random.default_rng(0)
        global_w = model(rng, dtype=np.float32)
        strategy.begin_round(1, global_w)
        for update, n in cohort(rng, 3, global_w):
            strategy.fold([u.astype(np.float32) for u in update], n)
        assert strategy.partial_sum().acc_dtypes == [np.dtype(np.float64)] * len(SHAPES)
