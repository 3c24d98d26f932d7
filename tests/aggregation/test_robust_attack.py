"""Robust rules vs 20% sign-flipped, x10-scaled updates on sklearn digits, with clients simulated in-process."""

import numpy as np
import pytest
import torch
from torch import nn

from fedpar.aggregation import Strategy, build_strategy
from fedpar.datasets import load_digits
from fedpar.models import build_model, get_weights, set_weights
from fedpar.parallel.device import flush_denormals

NUM_CLIENTS, NUM_ATTACKERS, ROUNDS = 10, 2, 12


def local_train(model, global_w, x, y, gen, epochs=3, batch=32, lr=0.3):
    """Plain SGD from the global weights; returns the new weights."""
    set_weights(model, global_w)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(batch):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return get_weights(model)


def accuracy(model, weights, x, y):
    set_weights(model, weights)
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def federate(strategy: Strategy, attack: bool) -> float:
    """ROUNDS rounds of FL; attackers send global - 10 * (honest update); returns final test accuracy."""
    torch.manual_seed(0)
    data = load_digits(seed=0)
    xtr, ytr = data.train.to_tensors()
    xte, yte = data.test.to_tensors()
    model = build_model("mlp", in_features=64, hidden=(64,), num_classes=10)
    parts = np.array_split(np.random.default_rng(0).permutation(len(ytr)), NUM_CLIENTS)
    gen = torch.Generator().manual_seed(1)
    g = get_weights(model)
    for r in range(1, ROUNDS + 1):
        strategy.begin_round(r, g)
        for c, idx in enumerate(parts):
            new = local_train(model, g, xtr[idx], ytr[idx], gen)
            if attack and c < NUM_ATTACKERS:
                new = [gw - 10.0 * (nw - gw) for nw, gw in zip(new, g)]
            strategy.fold(new, len(idx), client_id=f"client{c}")
        g, _ = strategy.finish()
    return accuracy(model, g, xte, yte)


@pytest.fixture(scope="module")
def clean_accuracy():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    flush_denormals()
    yield federate(build_strategy("fedavg"), attack=False)
    torch.set_num_threads(prev)


def test_fedavg_visibly_degrades_under_attack(clean_accuracy):
    assert clean_accuracy > 0.9
    attacked = federate(build_strategy("fedavg"), attack=True)
    assert attacked < clean_accuracy - 0.2, (attacked, clean_accuracy)


@pytest.mark.parametrize("name,kw", [("median", {}), ("trimmed_mean", {"beta": 0.2}),
                                     ("krum", {"num_malicious": 2}), ("multikrum", {"num_malicious": 2})])
def test_robust_rules_stay_within_5_points_of_clean(clean_accuracy, name, kw):
    attacked = federate(build_strategy(name, **kw), attack=True)
    assert attacked >= clean_accuracy - 0.05, (name, attacked, clean_accuracy)
