"""`--strategy flower:FedAvg` (Flower's Message-API strategies) in fedpar's round loop: configure_train's config
reaches the members, aggregate_train folds the round's replies, the same arrays as fedpar's fedavg for the same
updates (one fold, and a whole run of the example ClientApp over loopback gRPC); the strategy's own node sampling is
refused in one line."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from fedpar.aggregation import build_strategy, parse_strategy_options  # noqa: E402
from fedpar.aggregation.flower_message_strategy import FlowerMessageStrategy  # noqa: E402
from fedpar.aggregation.flower_strategy import FlowerStrategy  # noqa: E402
from fedpar.cli.main import main  # noqa: E402
from fedpar.client.agent import Agent, AgentConfig  # noqa: E402
from fedpar.client.flower_app_member import FlowerAppTrainer  # noqa: E402
from fedpar.server.assembly import CoordinatorAssembly  # noqa: E402
from fedpar.server.config import CoordinatorConfig  # noqa: E402
from fedpar.tasks.flower_app import load_flower_app  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower_app"


def updates(seed: int = 0):
    """A global model and three members' updates of it, with their example counts."""
    rng = np.random.default_rng(seed)
    global_arrays = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)]
    members = [[a + rng.normal(size=a.shape).astype(np.float32) for a in global_arrays] for _ in range(3)]
    return global_arrays, members, [10, 30, 7]


def one_round(name: str, **options):
    """The new global arrays and metrics of strategy ``name`` after one round of :func:`updates`."""
    global_arrays, members, counts = updates()
    strategy = build_strategy(name, **options)
    strategy.begin_round(1, global_arrays)
    settings = strategy.client_config(1)
    for i, (update, count) in enumerate(zip(members, counts)):
        strategy.fold(update, count, f"client-{i}")
    return strategy, settings, *strategy.finish()


def test_flower_fedavg_gives_fedpars_fedavg_arrays_for_the_same_updates():
    _, _, ours, _ = one_round("fedavg")
    strategy, settings, theirs, metrics = one_round("flower:FedAvg")
    assert isinstance(strategy, FlowerMessageStrategy)
    assert all(np.allclose(a, b, atol=1e-6) and a.dtype == b.dtype for a, b in zip(ours, theirs))
    assert metrics["num_examples"] == 47.0 and settings.fit_config is None
    _, members, counts = updates()
    _, _, median, _ = one_round("flower:FedMedian")
    assert np.allclose(median[0], np.median([m[0] for m in members], axis=0), atol=1e-6)
    _, _, legacy, _ = one_round("flower:flwr.server.strategy:FedAvg")  # the legacy API goes to its own adapter
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(ours, legacy))


def test_fedadams_moments_survive_a_checkpoint():
    global_arrays, members, counts = updates()

    def round_of(strategy, round_id, start):
        strategy.begin_round(round_id, start)
        strategy.client_config(round_id)
        for i, (update, count) in enumerate(zip(members, counts)):
            strategy.fold([u + round_id for u in update], count, f"client-{i}")
        return strategy.finish()[0]

    steady = build_strategy("flower:FedAdam", eta=0.1)
    after_one = round_of(steady, 1, global_arrays)
    arrays, meta = steady.state_dict()
    assert {"m_t.0", "v_t.0", "current_arrays.0"} <= set(arrays)
    resumed = build_strategy("flower:FedAdam", eta=0.1)
    resumed.load_state_dict(arrays, meta)
    expected, got = round_of(steady, 2, after_one), round_of(resumed, 2, after_one)
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))
    fresh = round_of(build_strategy("flower:FedAdam", eta=0.1), 2, after_one)
    assert not all(np.allclose(a, b) for a, b in zip(expected, fresh))  # the moments mattered


def test_configure_trains_config_reaches_the_members_and_proximal_mu_is_fedpars_own(tmp_path):
    module = tmp_path / "my_message_strategy.py"
    module.write_text("from flwr.serverapp.strategy import FedProx\n\n"
                      "class Configured(FedProx):\n"
                      "    def configure_train(self, server_round, arrays, config, grid):\n"
                      "        config['lr-decay'] = 0.5 ** server_round\n"
                      "        return super().configure_train(server_round, arrays, config, grid)\n")
    strategy, settings, _, _ = one_round(f"flower:{module}:Configured", proximal_mu=0.01)
    assert isinstance(strategy, FlowerMessageStrategy)
    assert settings.proximal_mu == 0.01 and settings.fit_config == {"lr-decay": 0.5}


def test_the_strategys_own_node_sampling_and_unknown_names_are_refused_in_one_line(capsys):
    with pytest.raises(ValueError, match="sizes the strategy's own node sample.*--clients-per-round"):
        parse_strategy_options("flower:FedAvg", {"fraction_train": "0.5"})
    with pytest.raises(ValueError, match="unknown option 'fraction_trian'") as unknown:  # a typo lists what is valid:
        parse_strategy_options("flower:FedAvg", {"fraction_trian": "0.5"})  # not the options refused above
    assert "weighted_by_key" in str(unknown.value) and "fraction_train" not in str(unknown.value), unknown.value
    assert "min_train_nodes" not in str(unknown.value)
    with pytest.raises(ValueError, match="flower:Nope is not a strategy of flwr.serverapp.strategy; choose one of "
                                         "Bulyan, .*FedAdam, FedAvg"):
        build_strategy("flower:Nope")
    assert isinstance(build_strategy("flower:flwr.server.strategy:FedAvg"), FlowerStrategy)
    with pytest.raises(ValueError, match="wraps another strategy instance.*--privacy central|client"):
        build_strategy("flower:DifferentialPrivacyServerSideFixedClipping")
    code = main(["simulate", "--strategy", "flower:FedAvg", "--strategy-option", "min_train_nodes=3", "--out",
                 "/nonexistent/never-written"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "option 'min_train_nodes' of flower:FedAvg sizes" in err



@pytest.mark.parametrize("typed, meant", [("FedAvgg", "FedAvg"), ("fedprox", "FedProx"), ("Nope", None)])
def test_a_mistyped_flower_class_is_offered_only_classes_fedpar_accepts(typed, meant, capsys):
    """The choices named DifferentialPrivacy...Clipping and QFedAvg, which fedpar then refused (QA)."""
    code = main(["simulate", "--strategy", f"flower:{typed}", "--out", "/nonexistent/never-written"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    said = f" (did you mean {meant}?)" if meant else ""
    assert f"flower:{typed} is not a strategy of flwr.serverapp.strategy{said}; choose one of " in err, err
    offered = err.partition("; choose one of ")[2].partition(", or give package.module:Class")[0].split(", ")
    assert {"FedAvg", "FedProx", "Krum", "Bulyan"} <= set(offered), err
    assert not [n for n in offered if n.startswith("DifferentialPrivacy") or n == "QFedAvg"], err
    for name in offered:  # each one offered is built
        build_strategy(f"flower:{name}")


def run_example(strategy: str, rounds: int = 2) -> list[np.ndarray]:
    """The final global arrays of ``rounds`` rounds of the example ClientApp's two members under ``strategy``
    (a real coordinator, the members as agents over loopback gRPC)."""
    app = load_flower_app(EXAMPLE, "local-epochs=1")
    initial = app.initial_arrays(0)
    assembly = CoordinatorAssembly([n for n, _ in initial], [a for _, a in initial])
    config = CoordinatorConfig(rounds=rounds, clients_per_round=2, min_available=2, overselect=1.0,
                               deadline_seconds=30.0, heartbeat_seconds=1.0, liveness_timeout_seconds=10.0,
                               local_epochs=1, batch_size=32, learning_rate=0.3, client_eval_every=0)
    server = assembly.server(config, build_strategy(strategy))
    server.start()
    try:
        agents = []
        for i in range(2):
            trainer = FlowerAppTrainer(app.client_app, app.run_config, initial)
            trainer.use_member(f"client-{i:04d}", i, 2, app.train_examples(i, 2))
            agents.append(Agent(AgentConfig(insecure=True, server=server.address, agent_id=f"client-{i:04d}",
                                            poll_seconds=1.0, initial_backoff=0.05, max_backoff=0.3,
                                            give_up_after=30, seed=i), trainer))
        threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
        for t in threads:
            t.start()
        assert server.wait(90)
        for t in threads:
            t.join(30)
    finally:
        server.stop()
    assert all(a.stats.accepted == rounds for a in agents)
    return [np.array(w) for w in server.coordinator.weights]


def test_a_run_under_flower_fedavg_ends_with_fedpars_fedavg_arrays():
    ours, theirs = run_example("fedavg"), run_example("flower:FedAvg")
    start = load_flower_app(EXAMPLE).initial_arrays(0)
    assert any(not np.allclose(a, s) for a, (_, s) in zip(ours, start))  # it trained
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))


ECHO_APP = {
    "pyproject.toml": """[project]
name = "echo-app"
version = "1.0.0"

[tool.flwr.app]
publisher = "fedpar-tests"

[tool.flwr.app.components]
serverapp = "echo_app.apps:server"
clientapp = "echo_app.apps:client"

[tool.flwr.app.config]
step = 0.1

[tool.fedpar]
model = "echo_app.apps:initial"
""",
    "echo_app/__init__.py": "",
    "echo_app/apps.py": '''"""A ClientApp whose evaluate handler echoes its config's eval-marker (numpy only)."""
import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

client = ClientApp()
server = ServerApp()


def initial():
    return ArrayRecord({"w": Array(np.zeros((2, 2), np.float32))})


@client.train()
def train(msg: Message, context: Context) -> Message:
    record = msg.content["arrays"]
    new = {k: Array(v.numpy() - np.float32(context.run_config["step"])) for k, v in record.items()}
    examples = 5 + int(context.node_config["partition-id"])
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": examples})}),
                   reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    echo = float(msg.content["config"].get("eval-marker", -1.0))
    metrics = MetricRecord({"eval_loss": 1.0, "echo": echo, "num-examples": 4})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
''',
}

MARKED_STRATEGY = """from flwr.serverapp.strategy import FedAvg


class Marked(FedAvg):
    def configure_evaluate(self, server_round, arrays, config, grid):
        config["eval-marker"] = 40.0 + server_round
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        replies = list(replies)
        aggregated = super().aggregate_evaluate(server_round, replies)
        aggregated["marker"] = 1000.0 + len(replies)
        return aggregated
"""


def test_configure_and_aggregate_evaluate_run_in_a_simulated_round(tmp_path, capsys):
    app = tmp_path / "echo"
    for name, text in ECHO_APP.items():
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(text)
    (tmp_path / "marked.py").write_text(MARKED_STRATEGY)
    out = tmp_path / "run"
    code = main(["simulate", "--flower-app", str(app), "--strategy", f"flower:{tmp_path / 'marked.py'}:Marked",
                 "--clients", "3", "--rounds", "2", "--workers", "1", "--quiet", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["status"], r["reported"]) for r in rows] == [("ok", 3), ("ok", 3)]
    # configure_evaluate's config reached every member's evaluate handler, aggregate_evaluate saw one reply each,
    # and its MetricRecord is the round's federated evaluation
    assert [r["federated_eval_echo"] for r in rows] == [41.0, 42.0]
    assert [r["federated_eval_marker"] for r in rows] == [1003.0, 1003.0]
    assert [r["federated_eval_loss"] for r in rows] == [1.0, 1.0]


def test_aggregate_evaluate_gets_one_reply_per_evaluated_member_and_a_raising_one_keeps_fedpars_means(tmp_path):
    strategy, settings, _, _ = one_round("flower:FedAvg")
    assert settings.eval_config is None  # FedAvg's configure_evaluate sends only server-round
    reports = [{"eval_loss": 2.0, "eval_accuracy": 0.5, "eval_examples": 10.0},
               {"eval_loss": 4.0, "eval_accuracy": 1.0, "eval_examples": 30.0}]
    assert strategy.aggregate_evaluation(reports) == {"federated_eval_loss": 3.5, "federated_eval_accuracy": 0.875}
    module = tmp_path / "raising_strategy.py"
    module.write_text("from flwr.serverapp.strategy import FedAvg\n\n"
                      "class Raising(FedAvg):\n"
                      "    def aggregate_evaluate(self, server_round, replies):\n"
                      "        raise RuntimeError('no')\n")
    raising, _, _, _ = one_round(f"flower:{module}:Raising")
    assert raising.aggregate_evaluation(reports) is None


DP = dict(noise_multiplier=1.0, clip_norm=1.0, population=10, clients_per_round=3, seed=0)


def masked_round(name: str, **options):
    """The new global arrays of strategy ``name`` handed :func:`updates`' round as secure aggregation hands it: their
    example-weighted mean, once, with the total weight."""
    global_arrays, members, counts = updates()
    strategy = build_strategy(name, **options)
    strategy.begin_round(1, global_arrays)
    strategy.client_config(1)
    mean = [sum(m[t].astype(np.float64) * n for m, n in zip(members, counts)) / sum(counts)
            for t in range(len(global_arrays))]
    strategy.fold_secure_sum([a.astype(np.float32) for a in mean], sum(counts), len(members))
    return strategy.finish()[0]


@pytest.mark.parametrize("name,options", [("flower:FedAvg", {}), ("flower:flwr.server.strategy:FedAvg", {}),
                                          ("flower:FedAdam", {"eta": 0.1}), ("flower:FedAvgM", {}),
                                          ("flower:flwr.server.strategy:FedYogi", {"eta": 0.1})])
def test_flowers_mean_strategies_give_the_same_model_from_a_masked_sum_as_from_each_update(name, options):
    _, _, each, _ = one_round(name, **options)
    masked = masked_round(name, **options)
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(each, masked))
    assert build_strategy(name, **options).secure_sum_refusal() is None


def test_dp_fedavg_around_flowers_fedavg_gives_dp_fedavg_arrays_and_flowers_robust_rules_are_refused():
    from fedpar.aggregation.compatibility import linear_flower

    _, _, ours, ours_metrics = one_round("dp-fedavg", **DP)
    _, _, theirs, metrics = one_round("dp-flower:FedAvg", **DP)  # the noisy mean, handed over as one result
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(ours, theirs))
    assert metrics["dp_epsilon"] == ours_metrics["dp_epsilon"]
    assert linear_flower("flower:FedProx") and not linear_flower("flower:FedMedian")
    assert not linear_flower("flower:flwr.server.strategy:Krum") and not linear_flower("flower:NoSuchStrategy")
    assert "needs each agent's result" in build_strategy("flower:FedMedian").secure_sum_refusal()
    with pytest.raises(ValueError, match="^--privacy cannot run with --strategy flower:FedTrimmedAvg"):
        build_strategy("dp-flower:FedTrimmedAvg", **DP)
