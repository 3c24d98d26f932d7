"""``Strategy.linear``: every strategy declares whether its new model depends on a round's updates only through their
weighted mean, the declaration holds, and secure aggregation and aggregator ranks take exactly the linear ones."""


import numpy as np
import pytest

from fedpar.aggregation import Strategy, build_strategy
from fedpar.aggregation.catalog import strategy_classes
from fedpar.aggregation.compatibility import linear_strategy_names
from fedpar.aggregation.registry import strategy_names
from fedpar.server.secure_round import check_secure_setup

SHAPES = [(4, 3), (3,), (2, 2, 2)]
# Multi-Krum with no malicious clients keeps every update, its weighted mean; with some it drops the outliers.
OPTIONS = {"multikrum": {"num_malicious": 2}}
DP = dict(noise_multiplier=1.0, clip_norm=1.0, population=10, clients_per_round=2, seed=0)


def test_every_registered_strategy_declares_whether_it_is_linear():
    assert "linear" not in vars(Strategy)  # the base assumes nothing: a class that does not say fails loudly
    for name, cls in strategy_classes().items():
        assert isinstance(cls.linear, bool), name
    assert build_strategy("dp-fedavg", **DP).linear is False  # clipping acts on each update
    # the weighted mean, or a server optimizer acting on it (the docs list linear_strategy_names() where they say so)
    assert {"fedavg", "fedavgm", "fedprox", "fedadam"} <= set(linear_strategy_names())
    assert linear_strategy_names() == [name for name in strategy_names() if strategy_classes()[name].linear]


def _rounds(strategy, rounds):
    """Run ``rounds`` (each a list of (update, weight)) on ``strategy``; the global model after each."""
    g = [np.zeros(s) for s in SHAPES]
    out = []
    for r, results in enumerate(rounds, start=1):
        strategy.begin_round(r, g)
        for j, (update, weight) in enumerate(results):
            strategy.fold(update, weight, f"c{j}")
        g, _ = strategy.finish()
        out.append(g)
    return out


@pytest.mark.parametrize("name", strategy_names())
def test_a_linear_strategy_gives_the_same_model_from_the_weighted_mean_alone(name):
    """What secure aggregation and aggregator ranks rely on: folding the weighted mean as one update of weight
    sum(w) gives the model that folding each update gives, round after round (server state included)."""
    rng = np.random.default_rng(7)
    rounds = [[([rng.standard_normal(s) + r for s in SHAPES], int(rng.integers(1, 30))) for _ in range(7)]
              for r in range(2)]
    merged = []
    for results in rounds:
        weights = np.array([w for _, w in results], float)
        mean = [np.average(np.stack([u[i] for u, _ in results]), axis=0, weights=weights) for i in range(len(SHAPES))]
        merged.append([(mean, int(weights.sum()))])
    each = _rounds(build_strategy(name, **OPTIONS.get(name, {})), rounds)
    try:
        once = _rounds(build_strategy(name, **OPTIONS.get(name, {})), merged)
        same = all(np.allclose(a, b, rtol=1e-9, atol=1e-12) for x, y in zip(each, once) for a, b in zip(x, y))
    except ValueError:  # a rule that cannot choose among one update
        same = False
    assert same == strategy_classes()[name].linear


def test_secure_aggregation_takes_exactly_the_linear_strategies_and_refuses_the_rest_in_the_tables_line():
    """And DP-FedAvg over a linear strategy in client mode without local noise (the agents clip; the server noises
    the sum), but not central DP or local noise, where the server would clip each update."""
    from fedpar.aggregation.compatibility import composition_features, refusal

    names, weights = ["w"], [np.zeros(3, np.float32)]
    dp_modes = {"dp-fedavg": DP, "dp-fedavg client": {**DP, "mode": "client"},
                "dp-fedavg local noise": {**DP, "mode": "client", "local_noise_multiplier": 0.1}}
    for name in [*strategy_names(), *dp_modes]:
        strategy = build_strategy(name.split()[0], **dp_modes.get(name, {}))
        if name in linear_strategy_names() or name == "dp-fedavg client":
            check_secure_setup(names, weights, strategy)
            assert strategy.secure_values == (1 if name.startswith("dp-") else 0)  # DP's clip bit rides along
        else:
            with pytest.raises(ValueError) as refused:
                check_secure_setup(names, weights, strategy)
            features = composition_features(name.split()[0], True, privacy=strategy.privacy_level)
            assert str(refused.value) == refusal(features)


def test_differential_privacy_refuses_every_registered_strategy_that_is_not_linear():
    """Each update is clipped and noised into a sum: a rule that needs the updates themselves cannot run on it."""
    from fedpar.aggregation.compatibility import check_composition, robust_strategies

    assert set(robust_strategies()) == set(strategy_names()) - set(linear_strategy_names())
    for name in robust_strategies():
        for refused in (lambda: check_composition(name, privacy="central"), lambda: build_strategy(f"dp-{name}", **DP)):
            with pytest.raises(ValueError, match=f"^--privacy cannot run with --strategy {name}: "):
                refused()


@pytest.mark.parametrize("strategy", ["krum", "median", "trimmed_mean", "flower:flwr.server.strategy:FedMedian"])
def test_the_secure_aggregation_refusal_of_a_strategy_lists_the_linear_ones(strategy, capsys):
    """--secure-aggregation's help says 'a refusal lists them': it did not, and the user had to guess one."""
    from fedpar.cli.main import main

    if strategy.startswith("flower:"):
        pytest.importorskip("flwr")
    assert main(["simulate", "--secure-aggregation", "--strategy", strategy, "--rounds", "1", "--quiet"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"fedpar simulate: --secure-aggregation cannot run with "
                                                   f"--strategy {strategy}: ")
    assert f"; use a linear strategy: {', '.join(linear_strategy_names())}" in lines[0]
    assert lines[0].endswith("or flower:FedYogi") == strategy.startswith("flower:")  # Flower's own that compose


@pytest.mark.parametrize("strategy", ["median", "flower:FedMedian"])
def test_the_privacy_refusal_of_a_strategy_lists_the_linear_ones_and_the_first_runs(strategy, tmp_path, capfd):
    """Following the differential-privacy guide with --strategy median said only why it cannot run (QA): the line
    now names the strategies that can, as the secure-aggregation refusal does, and the first of them runs."""
    from support.in_process import run_main

    if strategy.startswith("flower:"):
        pytest.importorskip("flwr")
    argv = ["simulate", "--clients", "4", "--rounds", "1", "--privacy", "central", "--quiet"]
    done = run_main([*argv, "--strategy", strategy, "--out", str(tmp_path / "refused")], capfd)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith(f"fedpar simulate: --privacy cannot run with --strategy {strategy}: DP-FedAvg ")
    assert f"; use a linear strategy: {', '.join(linear_strategy_names())}" in lines[0]
    first = linear_strategy_names()[0]
    ran = run_main([*argv, "--strategy", first, "--out", str(tmp_path / "ran")], capfd)
    assert ran.returncode == 0 and (tmp_path / "ran" / "global.safetensors").exists(), ran.stderr[-3000:]
