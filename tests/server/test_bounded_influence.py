"""An agent cannot set the global model through the example count FedAvg weights it by: the count declared at
Join is bounded (--max-examples-per-agent), must be positive, is fixed by the first Join, and bounds each
upload's weight; re-joining mid-round does not raise it. Real coordinator, scripted agents over loopback gRPC."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout

SHAPES = ((6, 4), (4,))
EPOCHS = 1


def _zeros():
    return [np.zeros(s, np.float32) for s in SHAPES]


def _refused(call, code, text):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code and text in err.value.details(), err.value.details()


def test_example_counts_outside_the_bound_are_refused_at_join(start_coordinator, agents):
    server = start_coordinator(_zeros(), clients_per_round=1, min_available=1,
                               max_examples_per_agent=1000, local_epochs=EPOCHS)
    bot = agents(server.address, ["probe"], num_examples=10)[0]
    for count in (0, 1001, 2 ** 62):
        _refused(lambda: bot.stub.Join(pb.JoinRequest(agent_id="greedy", num_examples=count), timeout=10),
                 grpc.StatusCode.INVALID_ARGUMENT, "--max-examples-per-agent")


def test_a_rejoin_cannot_raise_the_weight_and_the_model_moves_by_at_most_the_capped_share(start_coordinator,
                                                                                        agents):
    init = _zeros()
    server = start_coordinator(init, clients_per_round=3, min_available=3, local_epochs=EPOCHS)
    honest = agents(server.address, ["h1", "h2"], num_examples=100)
    attacker = agents(server.address, ["evil"], num_examples=100)[0]
    layout = ModelLayout.of_arrays(["t0", "t1"], init)
    tasks = {bot.agent_id: bot.task() for bot in [*honest, attacker]}
    # Mid-round the attacker joins again declaring a million examples, then claims them in its upload.
    reply = attacker.stub.Join(pb.JoinRequest(agent_id="evil", num_examples=1_000_000,
                                              replaces_token=attacker.auth.token), timeout=10)
    attacker.auth = pb.AgentAuth(agent_id="evil", token=reply.token)
    assert server.coordinator.registry.get("evil").num_examples == 100  # fixed by the first Join
    attack = [np.full(s, 1000.0, np.float32) for s in SHAPES]
    _refused(lambda: attacker.upload(tasks["evil"], attack, 1_000_000), grpc.StatusCode.INVALID_ARGUMENT,
             "must be in 1..100")
    assert attacker.upload(tasks["evil"], attack, 100 * EPOCHS).accepted  # the most it can claim
    for bot in honest:
        bot.download(tasks[bot.agent_id], layout)
        assert bot.upload(tasks[bot.agent_id], [np.ones(s, np.float32) for s in SHAPES], 100).accepted
    assert server.wait(30)
    assert server.coordinator.metrics.last["status"] == "ok"
    share = 100 / 300  # the attacker's capped weight over the round's total
    for new in server.coordinator.weights:
        np.testing.assert_allclose(new, share * 1000.0 + (1 - share) * 1.0, rtol=1e-5)


def test_with_a_share_cap_an_inflated_count_moves_the_model_by_at_most_the_capped_share(start_coordinator, agents):
    init = _zeros()
    server = start_coordinator(init, clients_per_round=5, min_available=5, local_epochs=EPOCHS,
                               max_examples_per_agent=10_000_000, max_agent_share=0.25)
    honest = agents(server.address, [f"h{i}" for i in range(4)], num_examples=100)
    attacker = agents(server.address, ["evil"], num_examples=10_000_000)[0]  # the most it may declare
    tasks = {bot.agent_id: bot.task() for bot in [*honest, attacker]}
    assert attacker.upload(tasks["evil"], [np.full(s, 1000.0, np.float32) for s in SHAPES], 10_000_000).accepted
    for bot in honest:
        assert bot.upload(tasks[bot.agent_id], [np.ones(s, np.float32) for s in SHAPES], 100).accepted
    assert server.wait(30) and server.coordinator.metrics.last["status"] == "ok"
    clean = 1.0  # the attacker-free model: every honest update is +1
    for new in server.coordinator.weights:  # the attacker holds exactly its capped quarter of the round
        np.testing.assert_allclose(new, 0.25 * 1000.0 + 0.75 * clean, rtol=1e-5)
        assert np.all(np.abs(new - clean) <= 0.25 * (1000.0 - clean) * (1 + 1e-5))


def test_serve_refuses_a_share_cap_for_a_strategy_that_does_not_weight_by_examples(capsys):
    from fedpar.cli.main import main
    assert main(["serve", "--port", "0", "--insecure", "--strategy", "median", "--max-agent-share", "0.5", "--rounds", "1"]) == 2
    assert "--max-agent-share does not apply" in capsys.readouterr().err
