"""A real agent's gRPC upload (client/transfer.py UpdateSender) is retried while the coordinator is busy, and counts
once it goes through."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
from torch import nn

from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.transfer import upload_messages
from fedpar.datasets.arrays import ArrayDataset
from fedpar.models import weight_specs
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
