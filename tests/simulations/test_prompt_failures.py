"""A simulated member whose own code fails its task is told to the coordinator at once (on the host's upload stream),
not with the host's next long-poll: the long-poll in flight as the member fails may wait up to --heartbeat seconds,
and a round that samples every member waited that long for it. A real host (client/runtime.py hosting
simulations/population.py's members) against a real coordinator over loopback gRPC, long-polls of 20 s: each round
closes in far less."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from fedpar.aggregation import build_strategy
from fedpar.datasets import load_dataset
from fedpar.datasets.members import member_source
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.config import CoordinatorConfig
from fedpar.simulations.population import PopulationSlice, host_population
from fedpar.task import Partition
from fedpar.tasks.zoo import classifier_for

CLIENTS, ROUNDS = 4, 3
LONG_POLL = 20.0  # the coordinator's cap on a long-poll's wait (--heartbeat), and the host's own


@pytest.mark.timeout(120)
def test_a_members_failed_task_reaches_the_coordinator_before_the_hosts_long_poll_returns():
    splits = load_dataset("digits")
    ended: list[float] = []  # time.monotonic() as each round closed
    rows: list[dict] = []
    server = CoordinatorAssembly.for_data("mlp", splits, 0, "cpu").server(
        CoordinatorConfig(min_available=CLIENTS, clients_per_round=CLIENTS, overselect=1.0, rounds=ROUNDS,
                          accept_populations=True, deadline_seconds=60.0, heartbeat_seconds=LONG_POLL,
                          liveness_timeout_seconds=3 * LONG_POLL),
        build_strategy("fedavg"), on_round_end=[rows.append, lambda row: ended.append(time.monotonic())])
    server.start()
    population = PopulationSlice.of("host-0", np.arange(CLIENTS), member_source(splits, "iid", CLIENTS, 0).sizes,
                                    np.zeros(CLIENTS))
    runtime = host_population(server.address, population, classifier_for("mlp", splits, "digits"),
                              lambda n, member: Partition(n, CLIENTS, member, "iid", 0, 0.1), seed=0, seats=2,
                              poll_seconds=LONG_POLL, max_backoff=0.5)
    assign = runtime.members.assign

    def failing_first(trainer, i, task):
        """Member 0's data fails to load in every round (its own code: the task's client_data, say)."""
        if i == 0:
            raise KeyError("no rows for this client")
        assign(trainer, i, task)

    runtime.members.assign = failing_first
    errors: list[BaseException] = []

    def run() -> None:
        try:
            runtime.run()
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)

    host = threading.Thread(target=run, daemon=True)
    host.start()
    try:
        assert server.wait(100), rows
        host.join(30)
    finally:
        runtime.stop()
        server.stop()
    assert not errors and not host.is_alive(), errors
    assert [(r["status"], r["reported"], r["rejected"], r["late"]) for r in rows] == [("ok", CLIENTS - 1, 1, 0)] * \
        ROUNDS, rows
    assert all("no rows for this client" in r["training_error"] for r in rows), rows
    # rounds 2 and 3 each began as the one before closed and, every member sampled, waited for member 0's word: told
    # only with the long-poll then in flight, each took about LONG_POLL
    gaps = np.diff(ended)
    assert (gaps < LONG_POLL / 2).all(), gaps
