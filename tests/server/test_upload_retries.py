"""A real agent's gRPC upload (client/transfer.py UpdateSender) is retried while the coordinator is busy, and counts
once it goes through."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
from torch import nn

from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.links import FatalAgentError
from fedpar.client.transfer import upload_messages
from fedpar.datasets.arrays import ArrayDataset
from fedpar.models import weight_specs
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from support.gated_trainer import GatedTrainer


def test_a_real_agent_retries_a_small_grpc_upload_while_the_upload_queue_is_full(start_coordinator, agents):
    torch.manual_seed(0)
    model = nn.Linear(16, 4)  # 272 bytes: one UploadSmall call
    init = [w.detach().numpy().copy() for w in model.parameters()]
    names = [n for n, _, _ in weight_specs(model)]
    server = start_coordinator(init, names=names, clients_per_round=2, min_available=2, max_queued_uploads=1,
                               max_concurrent_uploads=1,
                               upload_idle_seconds=20.0)
    (holder,) = agents(server.address, ["holder"])
    rng = np.random.default_rng(1)
    gate = threading.Event()
    trainer = GatedTrainer(model, ArrayDataset(rng.standard_normal((32, 16)).astype(np.float32),
                                                rng.integers(0, 4, 32)), gate=gate)
    agent = Agent(AgentConfig(insecure=True, server=server.address, agent_id="eager", poll_seconds=1.0,
                              give_up_after=20.0), trainer)
    runner = threading.Thread(target=agent.run)
    runner.start()
    task = holder.task()
    layout = ModelLayout.of_arrays(names, init)
    header, *rest = upload_messages(holder.auth, task, layout, init, 100, 1, {}, holder.max_chunk)
    go = threading.Event()

    def held():  # the holder's stream keeps the one queue place until the test lets its data go
        yield header
        assert go.wait(20)
        yield from rest

    replies = []
    sender = threading.Thread(target=lambda: replies.append(holder.upload(task, init, 100, messages=held())))
    sender.start()
    state = server.coordinator.current
    for _ in range(200):  # the holder's upload is in the queue
        if state.slots["holder"].status == "uploading":
            break
        time.sleep(0.02)
    assert state.slots["holder"].status == "uploading"
    gate.set()
    for _ in range(300):  # the agent's update is refused (the queue is full), and sent again
        if state.refused.get("resource_exhausted", 0) >= 2:
            break
        time.sleep(0.02)
    assert state.refused.get("resource_exhausted", 0) >= 2 and agent.stats.accepted == 0
    go.set()
    sender.join(20)
    assert replies and replies[0].accepted
    runner.join(30)
    assert not runner.is_alive() and server.wait(10)
    assert (agent.stats.accepted, agent.stats.refused) == (1, 0), agent.stats.refusals
    assert state.accepted == 2 and state.slots["eager"].status == "accepted"


def test_an_agent_says_once_that_its_coordinator_went_away_during_the_upload(start_coordinator, caplog):
    # a coordinator stopped by Ctrl-C leaves its agents retrying their uploads until the round's deadline, or their
    # --give-up-after when sooner (QA: exit 64 s after, with --give-up-after 5): they say so
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    init = [w.detach().numpy().copy() for w in model.parameters()]
    names = [n for n, _, _ in weight_specs(model)]
    server = start_coordinator(init, names=names, clients_per_round=1, min_available=1, deadline_seconds=60.0)
    rng = np.random.default_rng(1)
    gate, training = threading.Event(), threading.Event()

    class Held(GatedTrainer):
        def train(self, *args, **kwargs):
            training.set()
            return super().train(*args, **kwargs)

    trainer = Held(model, ArrayDataset(rng.standard_normal((32, 16)).astype(np.float32), rng.integers(0, 4, 32)),
                   gate=gate)
    agent = Agent(AgentConfig(insecure=True, server=server.address, agent_id="a", poll_seconds=1.0,
                              give_up_after=2.0), trainer)
    ended = []

    def run():
        try:
            agent.run()
        except FatalAgentError as exc:  # after the deadline it finds no coordinator for give_up_after: it gives up
            ended.append(str(exc))

    with caplog.at_level("INFO", logger="fedpar.client.transfer"):
        runner = threading.Thread(target=run)
        runner.start()
        assert training.wait(30)
        server.stop(grace=0)
        stopped = time.monotonic()
        gate.set()
        runner.join(60)
    assert not runner.is_alive() and ended and "unreachable for 2.0s" in ended[0], ended
    assert time.monotonic() - stopped < 20  # the upload's 2 s, then the pulls' 2 s: not the round's 60 s deadline
    said = [r.getMessage() for r in caplog.records if "coordinator unreachable while uploading" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("a: coordinator unreachable while uploading (") and \
        "retrying until --give-up-after, 2s from now" in said[0], said


def test_a_reported_task_failure_closes_the_agents_slot_and_is_kept_as_one_printable_line(start_coordinator, agents):
    init = [np.zeros(4, np.float32)]
    server = start_coordinator(init, clients_per_round=1, min_available=1, deadline_seconds=30.0)
    (agent,) = agents(server.address, ["a"])
    task = agent.task()
    agent.stub.PullTask(pb.PullTaskRequest(auth=agent.auth, wait_seconds=0.1, finished_task_id=task.task_id,
                                           failure="training raised \x1b[31mValueError\x1b[0m:\nbroken " + "x" * 900),
                        timeout=10)
    state = server.coordinator.current
    for _ in range(200):
        if state.training_failures:
            break
        time.sleep(0.02)
    assert state.training_failures == 1 and state.slots["a"].status == "rejected"
    assert state.training_error.startswith("training raised ?[31mValueError?[0m: broken xxx")
    assert state.training_error.isprintable() and len(state.training_error) < 600
