"""client/step_graph.py: a failed recording is tried again at the next step, and a model is left eager only after
GIVE_UP_AFTER failures in a row (one warning); the recording and replay themselves where CUDA is."""

import logging

import pytest
import torch
from torch import nn

from fedpar.client.step_graph import GIVE_UP_AFTER, GraphedSteps, Recordings


def test_a_passing_failure_is_retried_and_only_failures_in_a_row_leave_the_model_eager(caplog):
    recordings, model, other = Recordings(), nn.Linear(2, 2), nn.Linear(2, 2)
    caplog.set_level(logging.INFO, logger="fedpar.client.step_graph")
    for _ in range(GIVE_UP_AFTER - 1):
        recordings.failed(model, "operation failed due to a previous error during capture")
    assert recordings.recordable(model)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "the next step tries again" in caplog.records[0].getMessage()

    recordings.succeeded(model)  # the failures before were passing ones: the count starts again
    for _ in range(GIVE_UP_AFTER - 1):
        recordings.failed(model, "again")
    assert recordings.recordable(model)

    recordings.failed(model, "again")
    assert not recordings.recordable(model)
    recordings.failed(model, "once more")  # eager already: nothing more is said
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"{GIVE_UP_AFTER} times in a row (again)" in warnings[0], warnings
    assert recordings.recordable(other)  # another model is not affected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_is_recorded_once_and_replayed_as_it_ran_eagerly():
    device = torch.device("cuda", torch.cuda.current_device())
    total, step = torch.zeros(3, device=device), torch.ones(3, device=device)
    owner = nn.Linear(1, 1)

    def body():
        total.add_(step)
        step.mul_(2)

    steps = GraphedSteps(body, owner, device)
    for _ in range(6):
        steps.run()
    torch.cuda.synchronize(device)
    assert steps.recorded
    assert total.tolist() == [63.0] * 3  # 1 + 2 + ... + 32: every step ran once, eager or replayed
