"""Unchanged Flower NumPyClients (examples/flower_client.py) as fedpar agents against a real coordinator over
loopback gRPC: plain rounds, secure aggregation, a Flower strategy's fit config, and one-line refusals."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.client import NumPyClient  # noqa: E402

from fedpar.aggregation import build_strategy  # noqa: E402
from fedpar.cli.main import main  # noqa: E402
from fedpar.client.agent import Agent, AgentConfig  # noqa: E402
from fedpar.client.flower_client import (FlowerClientError, FlowerTrainer, flower_context,  # noqa: E402
                                         load_flower_client)
from fedpar.datasets import load_dataset  # noqa: E402
from fedpar.server.assembly import CoordinatorAssembly  # noqa: E402
from fedpar.server.config import CoordinatorConfig  # noqa: E402
from support.digit_agents import run_in_threads  # noqa: E402

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "flower_client.py")
FAST = dict(overselect=1.0, deadline_seconds=30.0, heartbeat_seconds=1.0, liveness_timeout_seconds=10.0,
            local_epochs=1, batch_size=32, learning_rate=0.1, min_available=2, clients_per_round=2)


def flower_agents(address: str, ids: list[str], clients=None) -> tuple[list[Agent], list[threading.Thread], list]:
    """One agent per id around the example's client for partition i of len(ids), each in a daemon thread."""
    agents = []
    for i, agent_id in enumerate(ids):
        client = load_flower_client(f"{EXAMPLE}:client_fn", flower_context(agent_id, i, len(ids)))
        if clients is not None:
            clients.append(client)
        trainer = FlowerTrainer(client, SPECS)
        agents.append(Agent(AgentConfig(insecure=True,
                                        server=address, agent_id=agent_id, poll_seconds=1.0, initial_backoff=0.05,
                                        max_backoff=0.3, give_up_after=30, seed=i), trainer))
    return agents, *run_in_threads(agents)


ASSEMBLY = CoordinatorAssembly.for_data("mlp", load_dataset("digits"), 0, "cpu")
SPECS = [(n, w.dtype.name, w.shape) for n, w in zip(ASSEMBLY.names, ASSEMBLY.weights)]


def serve(strategy, rows, **config):
    """A started coordinator of fedpar's digits MLP (central evaluation on) that records its metrics rows."""
    server = ASSEMBLY.server(CoordinatorConfig(**{**FAST, **config}), strategy, on_round_end=[rows.append])
    server.start()
    return server


def _agent_through_the_run(server, agent_id: str, client) -> Agent:
    """An agent of the Flower ``client`` that served ``server``'s run to its end (on a thread of this process)."""
    agent = Agent(AgentConfig(insecure=True, server=server.address, agent_id=agent_id, poll_seconds=1.0,
                              initial_backoff=0.05, max_backoff=0.3, give_up_after=30), FlowerTrainer(client, SPECS))
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    assert server.wait(60)
    thread.join(30)
    return agent


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure-aggregation"])
def test_flower_numpy_clients_complete_rounds_as_fedpar_agents(secure):
    rows = []
    server = serve(build_strategy("fedavg"), rows, rounds=2, secure_aggregation=secure)
    try:
        agents, threads, errors = flower_agents(server.address, ["fa", "fb"])
        assert server.wait(90)
        for t in threads:
            t.join(30)
    finally:
        server.stop()
    assert not errors
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["reported"] == 2 for r in rows)
    assert rows[-1]["test_accuracy"] > 0.5  # the coordinator's central evaluation of what the Flower clients trained
    for agent in agents:
        assert agent.stats.accepted == 2 and agent.stats.refused == 0, agent.stats.refusals
    if secure:  # the coordinator unmasked the two agents' sum
        assert all(r["secagg_survivors"] == 2 and "secagg_failure" not in r for r in rows)
    else:  # the clients' own evaluate and train loss reach the round's row
        assert 0 < rows[-1]["federated_eval_accuracy"] <= 1 and rows[-1]["train_loss"] > 0


class RecordingClient(NumPyClient):
    """Wraps a NumPyClient and remembers each fit config (to see what fedpar sends)."""

    def __init__(self, inner):
        self.inner, self.configs = inner, []

    def get_parameters(self, config):
        return self.inner.get_parameters(config)

    def fit(self, parameters, config):
        self.configs.append(dict(config))
        return self.inner.fit(parameters, config)

    def get_properties(self, config):
        return self.inner.get_properties(config)


def test_fit_config_carries_the_task_and_a_flower_strategys_configure_fit_config(tmp_path):
    module = tmp_path / "my_strategy.py"
    module.write_text("from flwr.server.strategy import FedProx\n\n"
                      "class Configured(FedProx):\n"
                      "    def __init__(self, proximal_mu: float = 0.0):\n"
                      "        super().__init__(on_fit_config_fn=lambda r: {'lr_decay': 0.5 ** r, 'tag': 'x'},\n"
                      "                         proximal_mu=proximal_mu)\n")
    rows = []
    server = serve(build_strategy(f"flower:{module}:Configured", proximal_mu=0.01), rows, rounds=1,
                   min_available=1, clients_per_round=1)
    try:
        inner = load_flower_client(f"{EXAMPLE}:client_fn", flower_context("solo", 0, 1))
        client = RecordingClient(inner)
        _agent_through_the_run(server, "solo", client)
    finally:
        server.stop()
    assert rows[0]["status"] == "ok"
    (config,) = client.configs
    assert 0 < config.pop("deadline_seconds") < 30
    assert config == {"server_round": 1, "local_epochs": 1, "batch_size": 32, "learning_rate": 0.1,
                      "proximal_mu": 0.01, "lr_decay": 0.5, "tag": "x"}


class Wrong(NumPyClient):
    """A client whose model is not the coordinator's (a float64 logistic regression)."""

    def get_parameters(self, config):
        return [np.zeros((10, 64)), np.zeros(10)]


def test_a_client_that_does_not_fit_the_model_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(FlowerClientError, match="expected 4 arrays, got 2"):
        FlowerTrainer(Wrong(), SPECS, num_examples=10)
    with pytest.raises(FlowerClientError, match="--flower-examples"):  # nor get_properties: no example count
        FlowerTrainer(Wrong(), [("w", "float64", (10, 64)), ("b", "float64", (10,))])
    module = tmp_path / "wrong_client.py"
    module.write_text("import numpy as np\nfrom flwr.client import NumPyClient\n\n"
                      "class C(NumPyClient):\n"
                      "    def get_parameters(self, config):\n"
                      "        return [np.zeros((128, 64)), np.zeros(128), np.zeros((10, 128)), np.zeros(10)]\n\n"
                      "def client_fn(context):\n    return C().to_client()\n")
    code = main(["client", "--insecure", "--server", "127.0.0.1:1", "--agent-id", "w", "--flower-client",
                 f"{module}:client_fn", "--flower-examples", "10"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err == ("fedpar client: the Flower client's get_parameters() does not fit the coordinator's model: "
                   "tensor 'net.0.weight': expected float32[128, 64], got 'net.0.weight' float64[128, 64]")
    code = main(["client", "--insecure", "--agent-id", "w", "--flower-client", f"{module}:nothing"])
    assert code == 2 and "has no client function called 'nothing'" in capsys.readouterr().err


class EvalRecording(NumPyClient):
    """A one-array client that records the configs its evaluate is given."""

    def __init__(self):
        self.configs = []

    def get_parameters(self, config):
        return [np.zeros(2, np.float32)]

    def evaluate(self, parameters, config):
        self.configs.append(dict(config))
        return 1.5, 4, {"accuracy": 0.25}


def test_a_message_strategys_configure_evaluate_config_reaches_a_numpy_clients_evaluate():
    from fedpar.protocol.task_settings import TaskSettings

    client = EvalRecording()
    trainer = FlowerTrainer(client, [("w", "float32", (2,))], num_examples=4)
    trainer.set_arrays([np.zeros(2, np.float32)])
    with trainer.holding_task(3):
        result = trainer.evaluate(TaskSettings(eval_config={"eval-marker": 41.0}))
        trainer.evaluate()
    assert client.configs == [{"server_round": 3, "eval-marker": 41.0}, {"server_round": 3}]
    assert (result.loss, result.accuracy, result.examples) == (1.5, 0.25, 4)


class FitsNothing(NumPyClient):
    """The example's client, but its fit forgets to return (None) and its evaluate returns a loss that is text."""

    def __init__(self, inner):
        self.inner = inner

    def get_parameters(self, config):
        return self.inner.get_parameters(config)

    def get_properties(self, config):
        return self.inner.get_properties(config)

    def fit(self, parameters, config):
        self.inner.fit(parameters, config)

    def evaluate(self, parameters, config):
        return "low", 10, {}


def test_a_client_whose_fit_or_evaluate_answers_the_wrong_kind_has_each_task_refused_saying_what_flower_expects():
    """The refusals read 'training raised TypeError: cannot unpack non-iterable NoneType object' and 'evaluation
    raised ValueError: could not convert string to float: 'low'' (QA)."""
    rows = []
    server = serve(build_strategy("fedavg"), rows, rounds=1, min_available=1, clients_per_round=1)
    try:
        client = FitsNothing(load_flower_client(f"{EXAMPLE}:client_fn", flower_context("none", 0, 1)))
        agent = _agent_through_the_run(server, "none", client)
    finally:
        server.stop()
    assert rows[0]["status"] == "failed" and agent.stats.accepted == 0
    assert any("evaluate() must return a number as its loss and a whole number of examples, got 'low' and 10: fix "
               "the client" in refusal for refusal in agent.stats.refusals), agent.stats.refusals
    client.evaluate = lambda parameters, config: (0.5, 10, {})
    trainer = FlowerTrainer(client, SPECS)
    trainer.set_arrays(client.get_parameters({}))
    with trainer.holding_task(1), pytest.raises(FlowerClientError, match=r"fit\(\) must return \(arrays, "
                                                r"num_examples, metrics\), three values .*, got None: fix the client"):
        trainer.train(1, 32, 0.1, round_id=1)


def test_a_client_function_or_get_parameters_that_raises_stops_the_agent_in_one_line(tmp_path, capsys):
    """Each ended `fedpar client` in a traceback (QA)."""
    module = tmp_path / "raising_client.py"
    module.write_text("from flwr.client import NumPyClient\n\n"
                      "class C(NumPyClient):\n"
                      "    def get_parameters(self, config):\n"
                      "        raise OSError('weights.pt is missing')\n\n"
                      "def client_fn(context):\n    return C().to_client()\n\n"
                      "def no_data(context):\n    raise FileNotFoundError('no partition here')\n")
    for fn, said in [("no_data", f"the client function {module}:no_data raised FileNotFoundError: no partition here"),
                     ("client_fn", "the Flower client's get_parameters() raised OSError: weights.pt is missing")]:
        code = main(["client", "--insecure", "--server", "127.0.0.1:1", "--agent-id", "w", "--flower-client",
                     f"{module}:{fn}", "--flower-examples", "10"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err == f"fedpar client: {said}: fix the client", err
