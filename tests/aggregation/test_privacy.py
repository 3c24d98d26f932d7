"""Differential privacy: clipping, noise scale, adaptive clip norm, accountant, checkpoints, client clipping."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from fedpar.aggregation import DPStrategy, FedAvg, FedAvgM, build_strategy
from fedpar.aggregation.clipping import clip_update, delta_norm, effective_noise_multiplier
from fedpar.client.transfer import dp_settings, privatize_update
from fedpar.protocol.codec import DP_CLIPPED, reported_clip


def _dp(**kw) -> DPStrategy:
    options = dict(noise_multiplier=1.0, clip_norm=1.0, population=100, clients_per_round=4, seed=0)
    options.update(kw)
    return DPStrategy(FedAvg(), **options)


def _model(values: np.ndarray) -> list[np.ndarray]:
    """A two-array model holding ``values`` (float32) split 3:rest."""
    values = np.asarray(values, np.float32)
    return [values[:3].copy(), values[3:].copy()]


def _flat(arrays) -> np.ndarray:
    return np.concatenate([np.ravel(a).astype(np.float64) for a in arrays])


TINY_NOISE = pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")  # epsilon is huge


@TINY_NOISE
def test_clipping_bounds_large_deltas_and_leaves_small_ones_untouched():
    g = np.linspace(-1, 1, 10)
    big, small = np.zeros(10), np.zeros(10)
    big[2], small[7] = 10.0, 0.5  # delta norms 10 and 0.5
    s = _dp(noise_multiplier=1e-9, clip_norm=1.0, clients_per_round=2)
    s.begin_round(1, _model(g))
    s.fold(_model(g + big), 500, "big")  # example counts are ignored: DP-FedAvg weights uniformly
    s.fold(_model(g + small), 1, "small")
    new, metrics = s.finish()
    expected = g + (big / 10.0 + small) / 2  # big clipped to norm 1, small kept, fixed denominator 2
    np.testing.assert_allclose(_flat(new), expected, atol=1e-6)
    assert metrics["dp_clipped_fraction"] == pytest.approx(0.5)
    assert metrics["dp_clip_norm"] == 1.0 and metrics["num_updates"] == 2.0


@TINY_NOISE
def test_fixed_denominator_divides_by_clients_per_round_not_by_reports():
    g = np.zeros(10)
    d = np.zeros(10)
    d[0] = 0.4
    s = _dp(noise_multiplier=1e-9, clip_norm=1.0, clients_per_round=4)
    s.begin_round(1, _model(g))
    s.fold(_model(g + d), 1, "only")
    new, _ = s.finish()
    np.testing.assert_allclose(_flat(new), d / 4, atol=1e-7)


def test_noise_added_at_finish_has_the_stated_standard_deviation():
    n = 200_000
    g = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    for kw in (dict(noise_multiplier=1.5, clip_norm=0.8),
               dict(noise_multiplier=1.5, clip_norm=0.8, target_quantile=0.5, count_noise=2.0)):
        s = _dp(clients_per_round=4, **kw)
        s.begin_round(1, _model(g))
        for i in range(4):
            s.fold(_model(g), 1, f"c{i}")  # zero deltas: what changes is the noise alone
        new, metrics = s.finish()
        z = kw["noise_multiplier"] if "target_quantile" not in kw else (1.5 ** -2 - 4.0 ** -2) ** -0.5
        assert metrics["dp_noise_multiplier"] == pytest.approx(z)
        assert metrics["dp_noise_std"] == pytest.approx(z * 0.8 / 4)
        noise = _flat(new) - g.astype(np.float64)
        assert abs(noise.mean()) < 5 * metrics["dp_noise_std"] / math.sqrt(n)
        assert noise.std() == pytest.approx(metrics["dp_noise_std"], rel=0.01)


def test_adaptive_clipping_converges_to_the_target_quantile():
    rng = np.random.default_rng(7)
    dim, clients = 8, 100
    g = np.zeros(dim)
    # q = 1 keeps the accountant cheap (opacus's subsampled RDP takes ~0.15 s per round)
    s = _dp(noise_multiplier=1.0, clip_norm=0.5, population=clients, clients_per_round=clients,
            target_quantile=0.5, clip_learning_rate=0.3)  # count noise: clients/20 = 5
    clips = []
    for r in range(1, 51):
        s.begin_round(r, _model(g))
        norms = rng.uniform(0.0, 10.0, clients)  # median 5
        for i, norm in enumerate(norms):
            direction = rng.standard_normal(dim)
            s.fold(_model(g + norm * direction / np.linalg.norm(direction)), 1, f"c{i}")
        _, metrics = s.finish()
        clips.append(metrics["dp_clip_norm"])
    assert clips[0] == 0.5 and clips[10] > clips[0]  # it moves toward the quantile from far below
    late = np.array(clips[-20:])  # from about 0.5 to the median 5 takes ~25 rounds at this step size
    assert 4.5 < late.mean() < 5.5 and late.min() > 4.0 and late.max() < 6.0


def test_epsilon_equals_opacus_rdp_accountant_and_grows_every_round():
    s = _dp(noise_multiplier=1.1, population=1000, clients_per_round=10, sampled_per_round=13, delta=1e-6)
    reference = RDPAccountant()
    g = np.zeros(6)
    eps = []
    for r in range(1, 8):
        s.begin_round(r, _model(g))
        s.fold(_model(g + 0.1), 1, "a")
        _, metrics = s.finish()
        reference.step(noise_multiplier=1.1, sample_rate=13 / 1000)
        assert metrics["dp_epsilon"] == pytest.approx(reference.get_epsilon(delta=1e-6), rel=1e-12)
        assert metrics["dp_sample_rate"] == pytest.approx(0.013) and metrics["dp_delta"] == 1e-6
        eps.append(metrics["dp_epsilon"])
    assert all(b > a > 0 for a, b in zip(eps, eps[1:]))


def test_epsilon_at_the_edge_of_the_orders_is_opacus_bound_without_its_warning(recwarn):
    # --privacy-noise 1e30 printed opacus's two-line UserWarning (optimal order is the largest alpha) under the table
    s = _dp(noise_multiplier=1e30, population=1000, clients_per_round=10, sampled_per_round=10, delta=1e-6)
    s.begin_round(1, _model(np.zeros(6)))
    s.fold(_model(np.ones(6)), 1, "a")
    _, metrics = s.finish()
    reference = RDPAccountant()
    reference.step(noise_multiplier=1e30, sample_rate=10 / 1000)
    with pytest.warns(UserWarning, match="Optimal order is the largest alpha"):  # opacus's own call still warns
        expected = reference.get_epsilon(delta=1e-6)
    assert metrics["dp_epsilon"] == pytest.approx(expected, rel=1e-12)
    assert not [w for w in recwarn.list if "Optimal order" in str(w.message)]


def test_aborted_round_costs_no_privacy():
    s = _dp()
    s.begin_round(1, _model(np.zeros(5)))
    s.fold(_model(np.ones(5)), 1, "a")
    s.abort_round()
    assert s.accountant.steps == 0 and s.accountant.epsilon() == 0.0


def _run(strategy, rounds, g):
    out = []
    for r in rounds:
        rng = np.random.default_rng([3, r])  # the same client updates in round r, however the run was split
        strategy.begin_round(r, g)
        for i in range(4):
            strategy.fold([a + rng.standard_normal(a.shape).astype(np.float32) for a in g], 1, f"c{i}")
        g, metrics = strategy.finish()
        out.append(metrics)
    return g, out


def test_state_dict_round_trip_continues_the_same_epsilon_clip_norm_and_weights():
    def make():
        return DPStrategy(FedAvgM(server_momentum=0.5), noise_multiplier=0.9, clip_norm=1.0, population=50,
                          clients_per_round=4, target_quantile=0.3, count_noise=1.0, seed=5)
    g0 = _model(np.zeros(12))
    straight = make()
    g_straight, m_straight = _run(straight, range(1, 6), g0)
    first = make()
    g_mid, _ = _run(first, range(1, 4), g0)
    arrays, meta = first.state_dict()
    meta = json.loads(json.dumps(meta))  # checkpoints hold JSON, nothing pickled
    assert meta["strategy"] == "dp-fedavgm" and meta["accountant"]["history"] == [[0.9, 0.08, 3]]
    resumed = make()
    resumed.load_state_dict({k: np.array(v) for k, v in arrays.items()}, meta)
    assert resumed.clip_norm == first.clip_norm and resumed.accountant.steps == 3
    g_resumed, m_resumed = _run(resumed, range(4, 6), g_mid)
    assert m_resumed[-1]["dp_epsilon"] == pytest.approx(m_straight[-1]["dp_epsilon"], rel=1e-12)
    assert m_resumed[-1]["dp_clip_norm"] == pytest.approx(m_straight[-1]["dp_clip_norm"], rel=1e-12)
    for a, b in zip(g_resumed, g_straight):
        np.testing.assert_array_equal(a, b)


def test_bad_accountant_history_in_a_checkpoint_is_refused():
    s = _dp()
    _, meta = s.state_dict()
    meta["accountant"]["history"] = [[0.0, 0.5, 3]]
    with pytest.raises(ValueError, match="accountant history"):
        s.load_state_dict({}, meta)


@TINY_NOISE
def test_client_mode_refuses_an_update_beyond_the_clip_norm_and_accepts_clipped_ones():
    g = _model(np.linspace(0, 1, 10))
    s = _dp(mode="client", clip_norm=0.5, noise_multiplier=1e-9, clients_per_round=2)
    assert s.client_config(1) == {"dp_clip_norm": 0.5, "dp_local_noise": 0.0}
    s.begin_round(1, g)
    liar = [a + 1.0 for a in g]  # delta norm sqrt(10) > 0.5
    with pytest.raises(ValueError, match="more than the DP clip norm"):
        s.fold(liar, 1, "liar")
    honest, clipped = privatize_update(liar, g, dp_settings(s.client_config(1)))
    assert clipped
    assert delta_norm(honest, g) == pytest.approx(0.5, rel=1e-5)
    s.fold(honest, 1, "honest")
    with pytest.raises(ValueError, match="more than the DP clip norm"):
        s.fold(liar, 1, "liar")  # a second try is refused too (the first left no trace)
    new, metrics = s.finish()
    assert metrics["num_updates"] == 1.0 and metrics["dp_clipped_fraction"] == 1.0
    np.testing.assert_allclose(_flat(new), _flat(g) + (_flat(honest) - _flat(g)) / 2, atol=1e-6)


def test_client_mode_counts_the_clients_clip_bits_not_the_norm_it_sees():
    # A lossy upload (top-k, int8) or local noise moves a clipped update's norm off C: the client's bit decides.
    g = _model(np.zeros(10))
    s = _dp(mode="client", clip_norm=1.0, noise_multiplier=1e-9, clients_per_round=3)
    s.begin_round(1, g)
    s.fold(_model(np.full(10, 0.01)), 1, "sparse-but-clipped", clipped=True)  # norm 0.03, well below C
    s.fold(_model(np.full(10, 0.01)), 1, "within", clipped=False)
    s.fold(_model(np.full(10, 0.01)), 1, "says-nothing")  # an older client: the norm decides (below C: unclipped)
    _, metrics = s.finish()
    assert metrics["dp_clipped_fraction"] == pytest.approx(1 / 3)
    central = _dp(clip_norm=1.0, noise_multiplier=1e-9, clients_per_round=1)  # central mode: the server clips
    central.begin_round(1, g)
    central.fold(_model(np.full(10, 0.01)), 1, "a", clipped=True)  # what a client says does not count there
    assert central.finish()[1]["dp_clipped_fraction"] == 0.0


@TINY_NOISE
def test_adaptive_clipping_with_local_noise_follows_the_clients_bits():
    # Local noise hides whether a client clipped: adaptive clipping takes the bits, and refuses an update without one.
    g = _model(np.zeros(10))
    s = _dp(mode="client", clip_norm=1.0, noise_multiplier=1e-9, clients_per_round=4, local_noise_multiplier=0.5,
            target_quantile=0.5, count_noise=1e-9)
    s.begin_round(1, g)
    for k in range(4):
        s.fold(_model(np.full(10, 0.1)), 1, f"c{k}", clipped=True)  # every client clipped: C must grow
    with pytest.raises(ValueError, match="does not say whether its client clipped it"):
        s.fold(_model(np.full(10, 0.1)), 1, "old")
    _, metrics = s.finish()
    assert metrics["dp_clipped_fraction"] == 1.0 and s.clip_norm > 1.0


def test_a_reported_clip_bit_is_0_or_1():
    assert reported_clip({}) is None
    assert reported_clip({DP_CLIPPED: 1.0}) is True and reported_clip({DP_CLIPPED: 0.0}) is False
    with pytest.raises(ValueError, match="must be 1 .clipped. or 0"):
        reported_clip({DP_CLIPPED: 0.5})


def test_client_side_clipping_module():
    g = [np.zeros((3, 4), np.float32), np.ones(5, np.float32)]
    far = [np.full((3, 4), 2.0, np.float32), np.full(5, 3.0, np.float32)]
    near = [np.full((3, 4), 0.01, np.float32), np.full(5, 1.01, np.float32)]
    clipped, was_clipped = privatize_update(far, g, dp_settings({"dp_clip_norm": 1.5}))
    assert was_clipped
    assert delta_norm(clipped, g) == pytest.approx(1.5, rel=1e-6)
    ratio = (clipped[0] - g[0]) / (far[0] - g[0])  # same direction, only shorter
    np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-5)
    assert all(c.dtype == np.float32 and c.shape == f.shape for c, f in zip(clipped, far))
    kept, was_clipped = privatize_update(near, g, dp_settings({"dp_clip_norm": 1.5}))
    assert not was_clipped
    assert all(np.array_equal(a, b) for a, b in zip(kept, near))
    assert privatize_update(far, g, dp_settings({"proximal_mu": 0.1})) == (far, None)  # no DP asked: unchanged
    big = [np.zeros(100_000, np.float32)]
    noisy, was_clipped = privatize_update(big, [np.zeros(100_000, np.float32)],
                                          dp_settings({"dp_clip_norm": 2.0, "dp_local_noise": 0.5}),
                                          rng=np.random.default_rng(0))
    assert not was_clipped  # the bit is about the update, not its noise
    assert noisy[0].std() == pytest.approx(1.0, rel=0.02)  # local noise std = 0.5 x 2.0
    for bad in ({"dp_clip_norm": 0}, {"dp_clip_norm": "x"}, {"dp_clip_norm": 1.0, "dp_local_noise": -1},
                {"dp_clip_norm": float("nan")}):
        with pytest.raises(ValueError, match="dp_clip_norm"):
            dp_settings(bad)
    with pytest.raises(ValueError, match="NaN or Inf"):
        clip_update([np.array([np.nan], np.float32)], [np.zeros(1, np.float32)], 1.0)


def test_build_strategy_wraps_any_strategy_and_validates_options():
    s = build_strategy("dp-fedprox", proximal_mu=0.1, noise_multiplier=0.8, clip_norm=2.0, population=20,
                       clients_per_round=5, mode="client")
    assert isinstance(s, DPStrategy) and s.inner.name == "fedprox" and s.name == "dp-fedprox"
    assert s.client_config(1) == {"proximal_mu": 0.1, "dp_clip_norm": 2.0, "dp_local_noise": 0.0}
    assert build_strategy("dp-fedavg", noise_multiplier=1, clip_norm=1, population=10,
                          clients_per_round=10).client_config(1) == {}  # central: clients learn nothing of DP
    with pytest.raises(ValueError, match=r"raise --privacy-count-noise \(e.g. to 2\) or lower --privacy-noise"):
        build_strategy("dp-fedavg", noise_multiplier=2.0, clip_norm=1, population=10, clients_per_round=10,
                       target_quantile=0.5, count_noise=0.9)  # 0.9 < 2.0 / 2
    # by default the count noise is clients_per_round / 20 but at least z: 10 of 10 at z = 2 (10/20 = 0.5 was refused)
    adaptive = build_strategy("dp-fedavg", noise_multiplier=2.0, clip_norm=1, population=10, clients_per_round=10,
                              target_quantile=0.5)
    assert adaptive.adaptive.count_noise == 2.0
    assert adaptive.update_noise_multiplier == pytest.approx(2.0 / 0.75 ** 0.5)  # (z^-2 - (2z)^-2)^-1/2
    with pytest.raises(ValueError, match="population"):
        build_strategy("dp-fedavg", noise_multiplier=1, clip_norm=1, population=5, clients_per_round=10)
    with pytest.raises(ValueError, match="unknown strategy"):
        build_strategy("dp-nope", noise_multiplier=1, clip_norm=1, population=5, clients_per_round=1)
    with pytest.raises(ValueError, match="local noise"):
        build_strategy("dp-fedavg", noise_multiplier=1, clip_norm=1, population=5, clients_per_round=1,
                       local_noise_multiplier=0.5)
    assert effective_noise_multiplier(1.0, 5.0) == pytest.approx((1 - 0.01) ** -0.5)


@TINY_NOISE
def test_a_float16_model_s_small_mean_delta_reaches_a_wrapped_server_optimizer():
    from fedpar.aggregation import FedAdam

    g = np.ones(10, np.float16)
    step = np.float16(2 ** -10)  # float16's rounding step at 1.0: the least change one client's update can carry
    wrapped = DPStrategy(FedAdam(eta=0.1), noise_multiplier=1e-9, clip_norm=10.0, population=100,
                         clients_per_round=4, seed=0)
    wrapped.begin_round(1, [g[:3].copy(), g[3:].copy()])
    wrapped.fold([g[:3] + step, g[3:] + step], 1, "moved")
    for name in ("still-1", "still-2", "still-3"):
        wrapped.fold([g[:3].copy(), g[3:].copy()], 1, name)
    new, _ = wrapped.finish()  # the mean delta, 2**-12, is below float16's step: rounded first, it would vanish
    assert [a.dtype for a in new] == [np.float16, np.float16]
    reference = FedAdam(eta=0.1)  # the same server step from the same mean, at float32
    reference.begin_round(1, [np.ones(3, np.float32), np.ones(7, np.float32)])
    reference.fold([np.full(3, 1 + 2 ** -12, np.float32), np.full(7, 1 + 2 ** -12, np.float32)], 1, "mean")
    expected, _ = reference.finish()
    np.testing.assert_array_equal(_flat(new), _flat([a.astype(np.float16) for a in expected]))
    assert _flat(new)[0] > 1.0  # the optimizer stepped (Adam's first step is about eta, whatever the delta's size)


@TINY_NOISE
def test_client_mode_takes_a_secure_sum_of_clipped_updates_as_it_takes_them_one_by_one():
    # Under secure aggregation the coordinator sees only the unmasked mean of the agents' clipped updates (each
    # weighing 1) and the count of their clip bits: the round must come out as the same updates folded one by one.
    rng = np.random.default_rng(3)
    g = rng.normal(size=10)
    deltas = [rng.normal(size=10) * scale for scale in (0.1, 3.0, 0.4, 5.0)]
    clipped_updates, bits = [], []
    for d in deltas:
        update, bit = privatize_update(_model(g + d), _model(g), dp_settings({"dp_clip_norm": 1.0}))
        clipped_updates.append(update)
        bits.append(bit)
    one_by_one, secure = (_dp(mode="client", target_quantile=0.5) for _ in range(2))
    one_by_one.begin_round(1, _model(g))
    for k, (update, bit) in enumerate(zip(clipped_updates, bits)):
        one_by_one.fold(update, 1, f"a{k}", clipped=bit)
    secure.begin_round(1, _model(g))
    mean = [np.mean([u[t].astype(np.float64) for u in clipped_updates], axis=0).astype(np.float32) for t in (0, 1)]
    secure.fold_secure_sum(mean, 4, 4, [float(sum(bits))])
    (new_a, metrics_a), (new_b, metrics_b) = one_by_one.finish(), secure.finish()
    np.testing.assert_allclose(_flat(new_b), _flat(new_a), atol=1e-6)
    assert metrics_b["dp_clipped_fraction"] == metrics_a["dp_clipped_fraction"] == sum(bits) / 4 == 0.75
    assert metrics_b["num_updates"] == 4.0 and metrics_b["dp_epsilon"] == metrics_a["dp_epsilon"]
    assert secure.clip_norm == pytest.approx(one_by_one.clip_norm)  # adaptive clipping moved C alike


def test_a_secure_sum_is_refused_where_the_server_would_clip_or_the_weights_are_not_one_each():
    assert _dp(mode="client").secure_sum_refusal() is None
    assert "--privacy central" in _dp().secure_sum_refusal()
    assert "local noise" in _dp(mode="client", local_noise_multiplier=0.1).secure_sum_refusal()
    s = _dp(mode="client")
    s.begin_round(1, _model(np.zeros(10)))
    with pytest.raises(ValueError, match="weighs 7 for 4 agents"):
        s.fold_secure_sum(_model(np.zeros(10)), 7, 4, [0.0])
    with pytest.raises(ValueError, match="counts 5.000 clipped updates of 4"):
        s.fold_secure_sum(_model(np.zeros(10)), 4, 4, [5.0])
    with pytest.raises(ValueError, match="counts 1.500 clipped updates of 4: an agent masked a clip bit other"):
        s.fold_secure_sum(_model(np.zeros(10)), 4, 4, [1.5])  # half a bit: no agent's clip bit is that
    s.fold_secure_sum(_model(np.zeros(10)), 4, 4, [1.0])  # the refusals changed nothing: it still takes one
    assert s.folded == 4


def test_a_dp_strategy_that_never_reports_epsilon_never_imports_opacus():
    # opacus's import is 2.5 s of CPU (scipy.stats, sympy): an aggregator rank other than 0 builds the DP strategy
    # and folds, and a resumed one loads the history, without ever being asked for epsilon
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys
        import numpy as np
        from fedpar.aggregation import DPStrategy, FedAvg
        s = DPStrategy(FedAvg(), noise_multiplier=1.0, clip_norm=1.0, population=100, clients_per_round=4, seed=0)
        s.accountant.step(1.0, 0.04)
        s.accountant.step(1.0, 0.04)
        s.accountant.step(2.0, 0.04)
        s.accountant.load_state(s.accountant.state())
        assert s.accountant.history == [(1.0, 0.04, 2), (2.0, 0.04, 1)], s.accountant.history
        print("opacus" in sys.modules)
        s.accountant.epsilon()
        print("opacus" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True"], done.stderr


def test_the_accountants_history_merges_rounds_as_opacus_does_and_its_epsilon_is_opacus():
    from fedpar.aggregation.accountant import PrivacyAccountant

    ours, reference = PrivacyAccountant(1e-5), RDPAccountant()
    for sigma, q in [(1.1, 0.01), (1.1, 0.01), (0.9, 0.01), (0.9, 0.02), (0.9, 0.02), (1.1, 0.01)]:
        ours.step(sigma, q)
        reference.step(noise_multiplier=sigma, sample_rate=q)
        assert ours.history == reference.history
        assert ours.epsilon() == reference.get_epsilon(delta=1e-5)
    resumed = PrivacyAccountant(1e-5)
    resumed.load_state(json.loads(json.dumps(ours.state())))
    assert resumed.history == ours.history and resumed.epsilon() == ours.epsilon()
