"""The local trainer stops before its deadline and reports the steps and examples it really trained on."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import ArrayDataset

N, BATCH = 200, 10


def _trainer(delay: float = 0.0) -> LocalTrainer:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 4)).astype(np.float32)
    torch.manual_seed(0)
    return LocalTrainer(nn.Linear(4, 3), ArrayDataset(x, rng.integers(0, 3, N)), seconds_per_step_delay=delay)


def test_without_a_deadline_every_epoch_is_trained_and_counted():
    result = _trainer().train(3, BATCH, 0.1)
    assert (result.steps, result.examples, result.stopped_early) == (3 * N // BATCH, 3 * N, False)


def test_a_deadline_stops_training_early_and_the_examples_are_the_ones_actually_seen():
    trainer = _trainer(delay=0.02)  # a slow device: about 50 steps a second
    before = [p.detach().clone() for p in trainer.model.parameters()]
    start = time.monotonic()
    result = trainer.train(100, BATCH, 0.1, stop_at=start + 0.5)
    assert time.monotonic() <= start + 0.5 + 0.25  # in time, give or take one step's jitter
    assert result.stopped_early and 0 < result.steps < 100 * N // BATCH
    assert result.examples == result.steps * BATCH  # N is a multiple of BATCH: every step saw a full batch
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_no_time_left_means_no_step_and_zero_examples():
    trainer = _trainer()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.train(1, BATCH, 0.1, stop_at=time.monotonic() - 1.0)
    assert (result.steps, result.examples, result.stopped_early) == (0, 0, True)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_local_sgd_is_bit_identical_to_torch_optim_sgd_and_skips_its_dynamo_import():
    trainer = _trainer()
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    trainer.warm_up()  # a zero-learning-rate step: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), reference.parameters()))
    trainer.train(2, BATCH, 0.1, round_id=3)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(trainer.seed * 1_000_003 + 3)  # the trainer's shuffling
    for _ in range(2):
        order = torch.randperm(N, generator=gen)
        for begin in range(0, N, BATCH):
            idx = order[begin:begin + BATCH]
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(reference(trainer.x[idx]), trainer.y[idx]).backward()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), reference.parameters()))


def test_training_in_a_fresh_process_does_not_import_torch_dynamo():
    import subprocess
    import sys

    code = ("import sys, numpy as np, torch\n"
            "from torch import nn\n"
            "from fedpar.client.trainer import LocalTrainer\n"
            "from fedpar.datasets import ArrayDataset\n"
            "x = np.zeros((20, 4), np.float32); y = np.zeros(20, np.int64)\n"
            "t = LocalTrainer(nn.Linear(4, 3), ArrayDataset(x, y)); t.warm_up(); t.train(1, 5, 0.1)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # 1.2 s of start-up per simulation worker process saved
