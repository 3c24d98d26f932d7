"""A Flower ClientApp as the trainer of fedpar's members: called with a proper Message and Context (partition,
run config, a state that persists across the member's rounds), and each reply that cannot be an update refused with
its reason, noted by the client runtime, the run going on (real coordinator, loopback gRPC); and a ServerApp's
Messages answered alike by a simulated member and a deployed agent (Flower's serde both ways)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import (Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, MetricRecord,  # noqa: E402
                      RecordDict)
from flwr.clientapp import ClientApp  # noqa: E402

from fedpar.aggregation import build_strategy  # noqa: E402
from fedpar.client.agent import Agent, AgentConfig  # noqa: E402
from fedpar.client.flower_app_member import FlowerAppAgent, FlowerAppTrainer, MemberStates  # noqa: E402
from fedpar.client.trainer_protocol import Trainer, UpdateRefused  # noqa: E402
from fedpar.protocol.flower_nodes import SERVER_NODE_ID, node_id_of  # noqa: E402
from fedpar.protocol.flower_wire import decode_message, encode_message  # noqa: E402
from fedpar.server.assembly import CoordinatorAssembly  # noqa: E402
from fedpar.server.config import CoordinatorConfig  # noqa: E402
from fedpar.simulations.client_app_population import ClientAppPopulation  # noqa: E402
from fedpar.simulations.population import PopulationSlice, client_id  # noqa: E402
from fedpar.task import Partition  # noqa: E402
from fedpar.tasks.flower_app import load_flower_app  # noqa: E402

INITIAL = [("w", np.zeros((3, 2), np.float32)), ("b", np.zeros(2, np.float32))]


def reply(msg: Message, arrays: dict | None = None, metrics: dict | None = None) -> Message:
    """A reply to ``msg`` carrying ``arrays`` (name -> ndarray) and ``metrics``."""
    content = RecordDict()
    if arrays is not None:
        content["arrays"] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    if metrics is not None:
        content["metrics"] = MetricRecord(metrics)
    return Message(content=content, reply_to=msg)


def plus_one_app(seen: list | None = None, mods: list | None = None) -> ClientApp:
    """A ClientApp adding 1 to every array; it counts its rounds in its Context.state and records what it gets."""
    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        counter = context.state.get("counter", MetricRecord({"rounds": 0}))
        counter["rounds"] = int(counter["rounds"]) + 1
        context.state["counter"] = counter
        if seen is not None:
            seen.append((msg.metadata.message_type, msg.metadata.group_id, msg.metadata.dst_node_id,
                         dict(context.node_config), dict(context.run_config), dict(msg.content["config"]),
                         int(counter["rounds"])))
        arrays = {k: a.numpy() + 1 for k, a in msg.content["arrays"].items()}
        return reply(msg, arrays, {"num-examples": 10, "train_loss": 0.5, "rounds": int(counter["rounds"])})

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return reply(msg, None, {"eval_loss": 1.5, "eval_acc": 0.25, "num-examples": 4})

    return app


def test_members_get_their_partition_run_config_and_a_state_that_persists_across_rounds():
    seen = []
    states = MemberStates(capacity=2)
    trainer = FlowerAppTrainer(plus_one_app(seen), {"local-epochs": 2}, INITIAL, states)
    assert isinstance(trainer, Trainer)
    for round_id in (1, 2, 3):
        for member, partition in (("client-0000", 0), ("client-0001", 1)):
            trainer.use_member(member, partition, 2, 10)
            trainer.set_arrays([a for _, a in INITIAL])
            with trainer.holding_task(round_id):
                assert trainer.evaluate().as_metrics() == {"eval_loss": 1.5, "eval_accuracy": 0.25, "eval_examples": 4}
                result = trainer.train(1, 8, 0.05, round_id=round_id)
            assert result.examples == 10 and result.loss == 0.5 and result.metrics == {"rounds": float(round_id)}
            assert [a.tolist() for a in trainer.get_arrays()] == [np.ones((3, 2)).tolist(), np.ones(2).tolist()]
    kind, group, node, node_config, run_config, config, rounds = seen[-1]
    assert (kind, group, node, rounds) == ("train", "3", node_id_of("client-0001"), 3)
    assert node_config == {"partition-id": 1, "num-partitions": 2} and run_config == {"local-epochs": 2}
    assert config["server-round"] == 3 and config["lr"] == 0.05 and config["local-epochs"] == 1
    assert config["batch-size"] == 8 and config["deadline-seconds"] > 0
    assert [s[-1] for s in seen] == [1, 1, 2, 2, 3, 3]  # each member's own count, kept across rounds
    trainer.use_member("client-0002", 2, 3, 10)  # a third member: the least recently used state is forgotten
    trainer.set_arrays([a for _, a in INITIAL])
    trainer.train(1, 8, 0.05, round_id=4)
    trainer.use_member("client-0000", 0, 3, 10)
    trainer.train(1, 8, 0.05, round_id=4)
    assert [s[-1] for s in seen[-2:]] == [1, 1] and len(states) == 2


def test_client_mods_wrap_the_handlers_as_in_flower():
    calls = []

    def mod(msg: Message, context: Context, call_next) -> Message:
        calls.append((msg.metadata.message_type, context.node_config["partition-id"]))
        answer = call_next(msg, context)
        if answer.content.metric_records:
            answer.content["metrics"]["modded"] = 1
        return answer

    trainer = FlowerAppTrainer(plus_one_app(mods=[mod]), {}, INITIAL)
    trainer.use_member("client-0003", 3, 4, 10)
    trainer.set_arrays([a for _, a in INITIAL])
    with trainer.holding_task(1):
        trainer.evaluate()
        result = trainer.train(1, 8, 0.1, round_id=1)
    assert calls == [("evaluate", 3), ("train", 3)] and result.metrics["modded"] == 1.0


def bad_app(kind: str) -> ClientApp:
    """A ClientApp whose train handler misbehaves as ``kind`` says."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        good = {k: a.numpy() + 1 for k, a in msg.content["arrays"].items()}
        if kind == "raises":
            raise RuntimeError("out of memory on the device")
        if kind == "error-reply":
            from flwr.app import Error
            return Message(Error(code=7, reason="dataset missing"), reply_to=msg)
        if kind == "no-arrays":
            return reply(msg, None, {"num-examples": 3})
        if kind == "renamed":
            return reply(msg, {"weight": good["w"], "b": good["b"]}, {"num-examples": 3})
        if kind == "reshaped":
            return reply(msg, {"w": good["w"].reshape(2, 3), "b": good["b"]}, {"num-examples": 3})
        if kind == "float64":
            return reply(msg, {"w": good["w"].astype(np.float64), "b": good["b"]}, {"num-examples": 3})
        if kind == "no-num-examples":
            return reply(msg, good, {"train_loss": 0.1})
        if kind == "not-a-message":
            return good
        raise AssertionError(kind)

    return app


@pytest.mark.parametrize("kind, reason", [
    ("raises", "train handler raised RuntimeError: out of memory on the device"),
    ("error-reply", "train reply carries an error: dataset missing"),
    ("no-arrays", "must hold exactly one ArrayRecord, it holds 0"),
    ("renamed", "its arrays are named ['weight', 'b'], the global model's ['w', 'b']"),
    ("reshaped", "does not fit the global model: tensor 'w': expected float32[3, 2]"),
    ("float64", "does not fit the global model: tensor 'w': expected float32[3, 2], got 'w' float64[3, 2]"),
    ("no-num-examples", "needs 'num-examples' (a whole number >= 1) in its MetricRecord, got None"),
    ("not-a-message", "train handler returned a dict, not a flwr.app.Message"),
])
def test_each_reply_that_cannot_be_an_update_is_refused_with_its_reason(kind, reason):
    trainer = FlowerAppTrainer(bad_app(kind), {}, INITIAL)
    trainer.use_member("client-0000", 0, 1, 10)
    trainer.set_arrays([a for _, a in INITIAL])
    with pytest.raises(UpdateRefused) as caught:
        trainer.train(1, 8, 0.1, round_id=1)
    assert reason in str(caught.value) and "\n" not in str(caught.value)
    assert trainer.evaluate() is None  # no evaluate handler: logged, training goes on


def test_a_refused_update_is_noted_by_the_runtime_and_the_round_goes_on_over_grpc(caplog):
    assembly = CoordinatorAssembly([n for n, _ in INITIAL], [a for _, a in INITIAL])
    rows = []
    config = CoordinatorConfig(rounds=2, clients_per_round=2, min_available=2, overselect=1.0, deadline_seconds=3.0,
                               heartbeat_seconds=1.0, liveness_timeout_seconds=10.0, local_epochs=1, batch_size=8,
                               learning_rate=0.1)
    server = assembly.server(config, build_strategy("fedavg"), on_round_end=[rows.append])
    server.start()
    agents = []
    try:
        for i, app in enumerate((plus_one_app(), bad_app("reshaped"))):
            trainer = FlowerAppTrainer(app, {}, INITIAL)
            trainer.use_member(f"member-{i}", i, 2, 10)
            agents.append(Agent(AgentConfig(insecure=True, server=server.address, agent_id=f"member-{i}",
                                            poll_seconds=1.0, initial_backoff=0.05, max_backoff=0.3,
                                            give_up_after=30, seed=i), trainer))
        threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
        for t in threads:
            t.start()
        assert server.wait(60)
        for t in threads:
            t.join(30)
    finally:
        server.stop()
    assert [(r["status"], r["reported"]) for r in rows] == [("ok", 1), ("ok", 1)]
    good, bad = agents
    assert good.stats.accepted == 2 and good.stats.refused == 0
    assert bad.stats.accepted == 0 and bad.stats.refused == 2
    assert [r.partition(": ")[0] for r in bad.stats.refusals] == ["round 1 train", "round 2 train"]
    assert all("the ClientApp's train reply does not fit the global model: tensor 'w'" in r for r in bad.stats.refusals)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "fedpar.client"]
    assert any(m.startswith("member-1: round 2 train refused: the ClientApp's train reply") for m in warned), warned
    assert all(np.allclose(w, 2.0) for w in server.coordinator.weights)  # two rounds of the good member's +1


def _server_message(node_id: int, round_id: int, arrays: dict[str, np.ndarray]) -> bytes:
    """A ServerApp's train Message to node ``node_id`` as fedpar's wire carries it (Flower's serde)."""
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                          "config": ConfigRecord({"lr": 0.1})})
    metadata = Metadata(run_id=7, message_id=f"m-{node_id}-{round_id}", src_node_id=SERVER_NODE_ID,
                        dst_node_id=node_id, reply_to_message_id="", group_id=str(round_id), created_at=time.time(),
                        ttl=60.0, message_type="train")
    return encode_message(Message(content=content, metadata=metadata))


def test_a_simulated_member_and_a_deployed_agent_answer_a_server_apps_message_alike():
    """The ServerApp route's two member sources (a simulation's ClientAppPopulation, a deployed FlowerAppAgent) call
    the ClientApp with the member's one Context: the same reply for the same partition, its state kept across
    rounds, and a handler that raises answered with Flower's error reply."""
    app = load_flower_app(Path(__file__).parent / "tiny_app", "fail-partition=1")
    assert app.client_app is not None  # imported now, with the app's folder on sys.path
    from tiny_flower_app.task import initial_arrays

    population = ClientAppPopulation(PopulationSlice.of("host-0", np.arange(2), None, np.zeros(2, np.float32)), app,
                                     lambda n, member: Partition(n, 2, member), seed=0, answers_messages=True)
    agents = []
    for n in range(2):
        trainer = FlowerAppTrainer(app.client_app, app.run_config, None)
        trainer.use_member(client_id(n), n, 2, 1)
        agents.append(FlowerAppAgent(client_id(n), trainer))
    assert population.answers_messages and all(a.answers_messages for a in agents)
    start = initial_arrays()
    for round_id in (1, 2):
        for n in range(2):
            data = _server_message(node_id_of(client_id(n)), round_id, start)
            answers = [population.answer(n, data, 1 << 20), agents[n].answer(0, data, 1 << 20)]
            assert all((a.error is not None) == (n == 1) for a in answers), answers  # the runtime counts it failed
            simulated, deployed = (decode_message(a.data, 1 << 20) for a in answers)
            for reply in (simulated, deployed):
                assert reply.metadata.reply_to_message_id == f"m-{node_id_of(client_id(n))}-{round_id}"
                if n == 1:
                    assert reply.has_error() and "fails on purpose" in reply.error.reason, reply.error.reason
                else:
                    assert not reply.has_error()
                    assert reply.content["metrics"]["rounds"] == round_id  # the member's Context.state persists
            if n == 0:
                for name in start:
                    np.testing.assert_array_equal(simulated.content["arrays"][name].numpy(),
                                                  deployed.content["arrays"][name].numpy())
                assert not np.array_equal(simulated.content["arrays"]["w"].numpy(), start["w"])
