"""The local trainer applies FedProx's proximal term: SGD on loss + mu/2 ||w - w_global||^2, checked by hand."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import ArrayDataset

N, D, C = 12, 3, 2
EPOCHS, BATCH, LR, SEED, ROUND = 2, 4, 0.5, 7, 3


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, D)).astype(np.float32)
    y = (x[:, 0] + 0.3 * rng.standard_normal(N) > 0).astype(np.int64)
    return ArrayDataset(x, y)


def _model():
    torch.manual_seed(1)
    return nn.Linear(D, C)


def _trained(mu):
    """(initial W, b), (trained W, b) of the real trainer with proximal coefficient ``mu``."""
    model = _model()
    start = [p.detach().numpy().astype(np.float64) for p in model.parameters()]
    LocalTrainer(model, _data(), seed=SEED).train(EPOCHS, BATCH, LR, proximal_mu=mu, round_id=ROUND)
    return start, [p.detach().numpy().astype(np.float64) for p in model.parameters()]


def _reference_sgd(start, mu):
    """Plain float64 SGD on mean cross-entropy + mu/2 ||w - w_start||^2, with the trainer's batch order."""
    data = _data()
    x, y = data.x.astype(np.float64), data.y
    w0, b0 = start
    w, b = w0.copy(), b0.copy()
    gen = torch.Generator().manual_seed(SEED * 1_000_003 + ROUND)  # the trainer's per-round batch order
    for _ in range(EPOCHS):
        order = torch.randperm(N, generator=gen).numpy()
        for begin in range(0, N, BATCH):
            idx = order[begin:begin + BATCH]
            logits = x[idx] @ w.T + b
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(idx)), y[idx]] -= 1.0  # d(mean CE)/d logits, times the batch size
            grad_w = p.T @ x[idx] / len(idx) + mu * (w - w0)
            grad_b = p.mean(axis=0) + mu * (b - b0)
            w, b = w - LR * grad_w, b - LR * grad_b
    return [w, b]


def _distance(a, b):
    return float(np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(a, b))))


def test_trainer_weights_equal_sgd_on_the_proximal_objective():
    for mu in (0.0, 0.8):
        start, trained = _trained(mu)
        for got, want in zip(trained, _reference_sgd(start, mu)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # The two objectives lead to clearly different weights: the check above does see the proximal term.
    assert _distance(_reference_sgd(start, 0.8), _reference_sgd(start, 0.0)) > 1e-2


def test_a_positive_mu_keeps_the_local_model_closer_to_the_global_one():
    start, plain = _trained(0.0)
    distances = [_distance(plain, start)]
    for mu in (0.3, 1.0):
        same_start, prox = _trained(mu)
        assert _distance(same_start, start) == 0.0  # same seed: same global weights and same batches
        distances.append(_distance(prox, start))
    assert distances[0] > distances[1] > distances[2] > 0, distances
