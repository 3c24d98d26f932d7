"""A worker's seats when --seats is not given: one where no seat would ever wait (the built-in data, its members'
updates small and sent in the background, no slow device sleeping), four where one would (so that the wait overlaps the next member's
training), and --seats as given."""

from __future__ import annotations

import numpy as np
import pytest

from fedpar.protocol.compressed_wire import CompressionConfig
from fedpar.server.config import CoordinatorConfig
from fedpar.simulations.config import WAITING_SEATS
from fedpar.simulations.population import PopulationSlice
from fedpar.simulations.runner import SimulationConfig, seats_of

SMALL = 20_000  # bytes: the digits MLP's model; its update rides in its host's background batches


def _slices(delays: list[float]) -> list[PopulationSlice]:
    return [PopulationSlice.of("host-0", np.arange(len(delays)), None, np.asarray(delays, np.float32), 0.0)]


@pytest.mark.parametrize("why, settings, delays, model_bytes", [
    ("a slow device sleeps", {}, [0.0, 0.05], SMALL),
    ("top-k awaits its verdict", {"upload_compression": CompressionConfig("topk", 0.1)}, [0.0, 0.0], SMALL),
    ("a secure round's masked upload goes on its own", {"secure_aggregation": True}, [0.0, 0.0], SMALL),
    ("an update larger than a chunk goes on its own", {}, [0.0, 0.0], CoordinatorConfig.max_chunk_bytes + 1),
    ("a user's task may read its members' data from disk", {"task": "examples/own_task.py:task"}, [0.0], SMALL),
])
def test_a_worker_whose_seats_would_wait_gets_several(why, settings, delays, model_bytes):
    assert seats_of(SimulationConfig(**settings), _slices(delays), model_bytes) == WAITING_SEATS, why


def test_a_flower_apps_members_reply_with_a_call_each_so_their_worker_gets_several_seats_unless_told():
    assert seats_of(SimulationConfig(), _slices([0.0]), SMALL, replies=True) == WAITING_SEATS
    assert seats_of(SimulationConfig(seats=2), _slices([0.0]), SMALL, replies=True) == 2


def test_a_worker_whose_seats_never_wait_gets_one_and_given_seats_are_kept():
    assert seats_of(SimulationConfig(), _slices([0.0, 0.0]), SMALL) == 1
    assert seats_of(SimulationConfig(upload_compression=CompressionConfig("int8")), _slices([0.0]), SMALL) == 1
    # under the virtual clock a slow device's steps are billed to its simulated time, not slept
    assert seats_of(SimulationConfig(virtual_clock=True), _slices([0.0, 0.05]), SMALL) == 1
    assert seats_of(SimulationConfig(seats=3), _slices([0.0, 0.05]), SMALL) == 3
