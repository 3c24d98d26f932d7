"""FedProx's Synthetic federations learn where they can be learnt: Synthetic(0, 0) on the clients that train (the
paper's 30 clients, all of them evaluated and all of them sampled), Synthetic-IID on every client."""

import numpy as np
import pytest
import torch

from fedpar.datasets import load_dataset
from fedpar.datasets.synthetic import SyntheticMembers, SyntheticSpec
from fedpar.simulations.runner import SimulationConfig, run_simulation


@pytest.mark.timeout(120)
def test_thirty_clients_of_synthetic_0_0_learn_above_chance_in_three_rounds():
    torch.set_num_threads(1)
    cfg = SimulationConfig(dataset="synthetic:0:0:30:20", clients=30, clients_per_round=10, rounds=3,
                           local_epochs=2, workers=1)
    rows = []
    summary = run_simulation(cfg, on_round=rows.append)
    assert summary["failed_rounds"] == 0
    test_y = load_dataset("synthetic:0:0:30:20").test.whole().y
    largest_class = np.bincount(test_y, minlength=10).max() / len(test_y)
    accuracy = [r["test_accuracy"] for r in rows]
    assert accuracy[-1] > max(0.25, largest_class + 0.1), accuracy  # measured: about 0.4; chance is 0.1


def test_synthetic_iid_clients_share_one_model_and_synthetic_0_0_clients_do_not():
    iid = SyntheticSpec.parse("synthetic:iid", clients=1000)
    assert iid.name == "synthetic:iid:1000:10" and SyntheticSpec.parse(iid.name) == iid
    assert SyntheticSpec.parse("synthetic:0:0", clients=1000).name == "synthetic:0:0:1000:10"
    # a least-squares linear read-out of the labels, fitted on some clients, scored on others it never saw
    for name, transfers in (("synthetic:iid:600:40", True), ("synthetic:0:0:600:40", False)):
        members = SyntheticMembers(SyntheticSpec.parse(name))
        seen = [members.examples(k) for k in range(0, 300)]
        unseen = [members.examples(k) for k in range(300, 600)]
        x, y = (np.concatenate([getattr(p, a) for p in seen]) for a in ("x", "y"))
        ux, uy = (np.concatenate([getattr(p, a) for p in unseen]) for a in ("x", "y"))
        ones = np.ones((len(x), 1), np.float32)
        coef = np.linalg.lstsq(np.hstack([x, ones]), np.eye(10)[y], rcond=None)[0]
        predicted = (np.hstack([ux, np.ones((len(ux), 1), np.float32)]) @ coef).argmax(axis=1)
        accuracy, largest = (predicted == uy).mean(), np.bincount(uy, minlength=10).max() / len(uy)
        assert (accuracy > largest + 0.1) if transfers else (accuracy < 0.15), (name, accuracy, largest)
