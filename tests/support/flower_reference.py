"""Flower's own run of a Flower App, in one process and without Ray: its ServerApp, strategy and ClientApp driven by
a minimal in-memory Grid that calls the ClientApp directly (Flower's InMemoryGrid needs a SuperLink's LinkState and
a SuperNode or the Ray simulation engine to answer its messages; this Grid answers them itself, as a SuperNode
would: ``client_app(message, context)`` with each node's Context kept across rounds)."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

SUPERLINK_NODE_ID = 1


class ReferenceGrid(Grid):
    """Nodes ``100 + partition`` for ``num_partitions`` partitions; each answers with ``client_app``."""

    def __init__(self, client_app, run_config: dict, num_partitions: int):
        self.client_app = client_app
        self._run = Run.create_empty(1)
        self.contexts = {100 + p: Context(run_id=1, node_id=100 + p, state=RecordDict(), run_config=dict(run_config),
                                          node_config={"partition-id": p, "num-partitions": num_partitions})
                         for p in range(num_partitions)}
        self._replies: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return Run(**vars(self._run))

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            context = self.contexts[message.metadata.dst_node_id]
            self._replies[message.metadata.message_id] = self.client_app(message, context)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


def run_with_flower(app_dir: Path, run_config_overrides: str | None, num_partitions: int) -> dict[str, np.ndarray]:
    """Run the app in ``app_dir`` with Flower's own objects on a :class:`ReferenceGrid`; the final arrays of the
    Result its strategy's ``start`` returned, by name (the ServerApp also saves what it saves itself)."""
    from fedpar.server.flower_grid import strategy_results
    from fedpar.tasks.flower_app import load_flower_app

    app = load_flower_app(app_dir, run_config_overrides)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID  # as Flower's runtime
    grid = ReferenceGrid(app.client_app, app.run_config, num_partitions)
    with strategy_results() as results:
        app.server_app(grid=grid, context=Context(run_id=1, node_id=SUPERLINK_NODE_ID, node_config={},
                                                  state=RecordDict(), run_config=dict(app.run_config)))
    arrays = results[-1].arrays
    return dict(zip(arrays.keys(), arrays.to_numpy_ndarrays()))
