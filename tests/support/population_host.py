"""A real coordinator that takes populations, on the digits MLP, and one simulation host's whole population of it: what
tests that drive a host in-process (its seats, its batcher) set up."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from fedpar.aggregation import build_strategy
from fedpar.datasets import load_dataset
from fedpar.datasets.members import member_source
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.config import CoordinatorConfig
from fedpar.simulations.agents import WorkerConfig, worker_task
from fedpar.simulations.population import PopulationSlice


@contextlib.contextmanager
def digits_population(clients: int, rows: list[dict], **config) -> Iterator[tuple[WorkerConfig, object]]:
    """A started coordinator (``CoordinatorConfig(**config)``, taking populations, every round's row appended to
    ``rows``) and the WorkerConfig and task of one host of all ``clients`` members (digits, iid); stopped after."""
    splits = load_dataset("digits")
    server = CoordinatorAssembly.for_data("mlp", splits, 0, "cpu").server(
        CoordinatorConfig(min_available=clients, accept_populations=True, deadline_seconds=60.0,
                          heartbeat_seconds=1.0, **config),
        build_strategy("fedavg"), on_round_end=[rows.append])
    server.start()
    try:
        population = PopulationSlice.of("host-0", np.arange(clients),
                                        member_source(splits, "iid", clients, 0).sizes, np.zeros(clients))
        worker = WorkerConfig(server=server.address, population=population, clients=clients, device="cpu")
        yield worker, worker_task(worker, splits)
    finally:
        server.stop()
