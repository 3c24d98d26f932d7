"""The Flower strategy adapter (aggregation/flower_strategy.py): options, refusals, saved state, odd answers.
Its results against fedpar's own strategies are in test_strategies.py; a round over gRPC in tests/server."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.server.strategy import FedAvg as FlowerFedAvg  # noqa: E402

from fedpar.aggregation import build_strategy, parse_strategy_options  # noqa: E402
from fedpar.aggregation.flower_strategy import FlowerStrategy  # noqa: E402
from fedpar.cli.main import main  # noqa: E402

FEDAVGM = "flower:flwr.server.strategy:FedAvgM"


def cohort(rng, g, k=4):
    return [([w + 0.1 * rng.standard_normal(w.shape).astype(w.dtype) for w in g], int(rng.integers(1, 20)))
            for _ in range(k)]


def run_round(strategy, r, g, results):
    strategy.begin_round(r, g)
    strategy.client_config(r)
    for j, (u, n) in enumerate(results):
        strategy.fold(u, n, client_id=f"c{j}")
    return strategy.finish()[0]


def test_options_are_typed_from_text_and_flowers_sampling_is_refused():
    assert parse_strategy_options(FEDAVGM, {"momentum": "0.9", "server-learning-rate": "0.5"}) == \
        {"server_momentum": 0.9, "server_learning_rate": 0.5}
    with pytest.raises(ValueError, match="unknown option 'momentun'.*valid options: .*server_momentum"):
        parse_strategy_options(FEDAVGM, {"momentun": "0.9"})
    with pytest.raises(ValueError, match="'min_fit_clients' .* fedpar's sampler replaces; .*--clients-per-round"):
        parse_strategy_options(FEDAVGM, {"min_fit_clients": "5"})
    with pytest.raises(ValueError, match="fraction_fit"):
        build_strategy(FEDAVGM, fraction_fit=0.5)
    with pytest.raises(ValueError, match="'numpy:ndarray' is not a Flower strategy class"):
        build_strategy("flower:numpy:ndarray")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        build_strategy("flower:no_such_module:Thing")
    with pytest.raises(ValueError, match="--privacy cannot run with --strategy flower:.*needs each agent's result"):
        build_strategy("dp-flower:flwr.server.strategy:FedMedian", noise_multiplier=1.0, clip_norm=1.0, population=10,
                       clients_per_round=2)


def fedavgm():
    return build_strategy(FEDAVGM, server_momentum=0.9, server_learning_rate=0.7)


def test_momentum_and_the_running_global_survive_a_checkpoint():
    rng = np.random.default_rng(0)
    g0 = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)]
    cohorts = [cohort(rng, g0) for _ in range(3)]
    straight, g = fedavgm(), g0
    for r, results in enumerate(cohorts, start=1):
        g = run_round(straight, r, g, results)
    first, g_before = fedavgm(), g0
    for r, results in enumerate(cohorts[:2], start=1):
        g_before = run_round(first, r, g_before, results)
    arrays, meta = first.state_dict()
    assert set(meta["flower_arrays"]) == {"initial_parameters", "momentum_vector"}
    resumed = fedavgm()  # a restarted coordinator: built afresh, then loaded from the checkpoint (JSON + arrays)
    resumed.load_state_dict(arrays, json.loads(json.dumps(meta)))
    for got, want in zip(run_round(resumed, 3, g_before, cohorts[2]), g):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match="saved by strategy 'flower:.*FedAvgM', not 'flower:.*FedAvg'"):
        build_strategy("flower:flwr.server.strategy:FedAvg").load_state_dict(arrays, meta)


class Abstaining(FlowerFedAvg):
    """Answers no parameters on even rounds and float64 arrays on odd ones."""

    def aggregate_fit(self, server_round, results, failures):
        params, metrics = super().aggregate_fit(server_round, results, failures)
        if server_round % 2 == 0:
            return None, {}
        from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
        return ndarrays_to_parameters([a.astype(np.float64) for a in parameters_to_ndarrays(params)]), \
            {"seen": len(results), "note": "text is dropped"}


def test_an_instance_runs_as_is_and_odd_answers_are_made_safe():
    rng = np.random.default_rng(1)
    g = [rng.standard_normal((2, 2)).astype(np.float32)]
    s = FlowerStrategy(Abstaining(fit_metrics_aggregation_fn=lambda m: {}))
    assert s.name == f"flower:{__name__}:Abstaining"
    s.begin_round(1, g)
    s.fold([g[0] + 1], 3, "a")
    with pytest.raises(ValueError, match="NaN or Inf"):
        s.fold([np.full((2, 2), np.nan, np.float32)], 3, "b")
    with pytest.raises(ValueError, match="already contributed"):
        s.fold([g[0]], 3, "a")
    new, metrics = s.finish()
    assert new[0].dtype == np.float32 and np.allclose(new[0], g[0] + 1)  # cast back to the model's dtype
    assert metrics["flower_seen"] == 1 and "flower_note" not in metrics and metrics["num_updates"] == 1
    s.begin_round(2, new)
    s.fold([new[0] + 1], 3, "a")
    kept, _ = s.finish()
    assert kept[0] is new[0]  # no parameters: the global model stays
    with pytest.raises(ValueError, match="options go to a Flower strategy class"):
        FlowerStrategy(Abstaining(), eta=1.0)


MEDIAN = "flower:flwr.server.strategy:FedMedian"


@pytest.mark.parametrize("flags,message", [
    (["--secure-aggregation"], f"--secure-aggregation cannot run with --strategy {MEDIAN}: the coordinator only "
                               "sees the sum of the masked updates"),
    (["--privacy", "central", "--privacy-population", "10"],
     f"--privacy cannot run with --strategy {MEDIAN}: DP-FedAvg releases only the noisy sum"),
])
def test_serve_refuses_what_a_flower_strategy_cannot_run_in_one_line(tmp_path, capsys, flags, message):
    code = main(["serve", "--insecure", "--port", "0", "--no-central-eval", "--strategy", MEDIAN,
                 "--out", str(tmp_path), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and message in err, err


def test_a_message_api_strategy_that_needs_each_members_training_loss_is_refused_in_one_line():
    """flower:QFedAvg was built, then every round's aggregate_train raised AggregationError ('Missing or invalid
    training loss'): the replies fedpar hands a strategy carry only the arrays and the example count."""
    with pytest.raises(ValueError, match=r"^flower:QFedAvg weighs each reply by the member's training loss, .*; "
                                         r"choose another strategy$"):
        build_strategy("flower:QFedAvg", client_learning_rate=0.1)
