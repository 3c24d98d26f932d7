"""parallel/trainer.LossReadout: what a training bar shows as each step's loss, without a wait for the GPU."""

from __future__ import annotations

import math

import pytest
import torch

from fedpar.parallel.trainer import LossReadout


def test_on_the_cpu_the_bar_shows_each_steps_own_loss():
    readout = LossReadout(torch.device("cpu"))
    assert [readout.latest(torch.tensor(v)) for v in (2.5, 1.25, 0.5)] == [2.5, 1.25, 0.5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU readout is tested above")
def test_on_a_gpu_the_bar_shows_the_newest_loss_that_arrived_without_waiting_for_the_step():
    readout = LossReadout(torch.device("cuda"))
    torch.cuda._sleep(200_000_000)  # keeps the GPU busy, so the first copy cannot have arrived yet
    assert math.isnan(readout.latest(torch.full((), 2.5, device="cuda")))
    torch.cuda.synchronize()
    assert readout.latest(torch.full((), 1.0, device="cuda")) == 2.5
    torch.cuda.synchronize()
    assert readout.latest(torch.full((), 0.5, device="cuda")) == 1.0
