"""A worker's members of a round trained stacked (client/batched_trainer.py) against one by one (the local loop of
each member's own trainer), in thread CPU time, so that other work on the machine costs neither way much: the
training alone, none of the round's service around it.

Each cell is one worker's share of a round on 2 workers, one torch thread, the median of ``--repeats`` runs of each
way, alternated:
- digits MLP, E1 B32 (the steady-round cells): 5 members of 13 examples (10 of 100: one step each), 5 of 130
  (10 of 10) and 50 of 13 (100 of 100);
- digits CNN (the FedAvg paper's CNN on 8x8 images), `fedpar simulate`'s defaults E5 B16: the same three shapes;
- MNIST CNN (with ``--mnist-dir`` holding MNIST): the FedAvg paper's round, 10 of 100 clients of 600 examples, B10
  (5 members a worker; ``--mnist-epochs``, default 1: the steps are alike from epoch to epoch, E5 is five times
  as many), and 5 and 50 members of 6 examples (10,000 clients, 100 a round, E5 B16);
- MNIST MLP, E1 B16: 10 of 10 (5 members of 5,400 examples) and 100 of 100 (50 of 540).
``--models`` picks the cells (mlp, cnn, mnist-cnn, mnist-mlp). Writes benchmarks/results/stacked_cpu_bench.json
(``--json``: elsewhere).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results import write_results  # noqa: E402

from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.client.batched_trainer import ClientBatchInput, member_tensors, train_clients_batched  # noqa: E402
from fedpar.client.trainer import LocalTrainer  # noqa: E402
from fedpar.datasets import load_dataset  # noqa: E402
from fedpar.models.for_data import build_model_for_data  # noqa: E402

LR, ROUND = 0.05, 1
# (cells, model, dataset): each cell (members, examples each, epochs, batch size, the round it is a worker's share of)
CELLS = {
    "mlp": ("mlp", "digits", ((5, 13, 1, 32, "10 of 100"), (5, 130, 1, 32, "10 of 10"), (50, 13, 1, 32, "100 of 100"))),
    "cnn": ("cnn", "digits", ((5, 13, 5, 16, "10 of 100"), (5, 130, 5, 16, "10 of 10"), (50, 13, 5, 16, "100 of 100"))),
    "mnist-cnn": ("cnn", "mnist", ((5, 600, None, 10, "FedAvg paper: 10 of 100"), (5, 6, 5, 16, "100 of 10,000"),
                                   (50, 6, 5, 16, "100 of 100 (6 examples)"))),
    "mnist-mlp": ("mlp", "mnist", ((5, 5400, 1, 16, "10 of 10"), (50, 540, 1, 16, "100 of 100"))),
}


def main() -> int:
    p = FedparParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30, help="runs of each way, alternated")
    p.add_argument("--models", default="mlp,cnn,mnist-cnn,mnist-mlp", help=f"the cells of these ({', '.join(CELLS)})")
    p.add_argument("--mnist-dir", default=str(HERE.parent.parent / "shared" / "data" / "mnist"))
    p.add_argument("--mnist-epochs", type=int, default=1, help="local epochs of the FedAvg paper's MNIST cell")
    p.add_argument("--json", type=Path, default=HERE / "results" / "stacked_cpu_bench.json", help="where it goes")
    a = p.parse_args()
    torch.set_num_threads(1)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"thread CPU ms, one torch thread; load average {' '.join(load)}")
    print(f"{'model':>10}{'cell':>26}{'members':>8}{'each':>6}{'E':>3}{'B':>4}{'stacked':>10}{'one by one':>11}"
          f"{'ratio':>7}")
    cells, ratios = [], []
    for name in a.models.split(","):
        arch, dataset, shapes = CELLS[name]
        if dataset == "mnist" and not (Path(a.mnist_dir) / "train.npz").exists():
            print(f"{name}: no MNIST in {a.mnist_dir}, skipped")
            continue
        splits = load_dataset(dataset, a.mnist_dir if dataset == "mnist" else None)
        torch.manual_seed(0)
        model = build_model_for_data(arch, splits.input_shape, splits.num_classes)
        for k, size, epochs, batch, cell in shapes:
            epochs = epochs or a.mnist_epochs
            c = measure(model, splits, k, size, epochs, batch, a.repeats)
            c.update({"model": name, "cell": cell, "members": k, "examples_each": size, "epochs": epochs,
                      "batch_size": batch, "steps_each": -(-size // batch) * epochs,
                      "load_average": Path("/proc/loadavg").read_text().split()[:3]})
            cells.append(c)
            print(f"{name:>10}{cell:>26}{k:>8}{size:>6}{epochs:>3}{batch:>4}{c['stacked_ms']:>10.1f}"
                  f"{c['one_by_one_ms']:>11.1f}{c['stacked_vs_one_by_one']:>7.2f}  load {' '.join(c['load_average'])}",
                  flush=True)
            load = " ".join(c["load_average"])
            ratios.append({"what": f"{k} {dataset} {arch.upper()} members of {size} examples trained stacked, "
                                   f"E{epochs} B{batch}, thread CPU time ({cell} on 2 workers; load {load})",
                           "ratio": c["stacked_vs_one_by_one"], "against": "the same members one by one, same run"})
    path = write_results(a.json, ratios, {"repeats": a.repeats, "cells": cells})
    print(f"wrote {path}")
    return 0


def measure(model: torch.nn.Module, splits, k: int, size: int, epochs: int, batch: int, repeats: int) -> dict:
    """Median thread CPU ms of ``k`` members of ``size`` examples trained stacked and one by one, alternated."""
    subsets = [splits.train.subset(np.arange(j * size, (j + 1) * size) % len(splits.train)) for j in range(k)]
    tensors = [member_tensors(s) for s in subsets]
    alone = [LocalTrainer(copy.deepcopy(model), s, seed=j) for j, s in enumerate(subsets)]

    def stacked():
        train_clients_batched(model, [ClientBatchInput(x, y, seed=j) for j, (x, y) in enumerate(tensors)],
                              epochs, batch, LR, ROUND)

    def one_by_one():
        for trainer in alone:
            trainer.train(epochs, batch, LR, round_id=ROUND)

    ways = {"stacked": stacked, "one_by_one": one_by_one}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for fn in ways.values():
        fn()  # first-call set-up (torch.func's) is not a round's
    for repeat in range(repeats):
        for name in ways if repeat % 2 == 0 else reversed(ways):
            start = time.thread_time()
            ways[name]()
            seconds[name].append(time.thread_time() - start)
    c = {f"{name}_ms": statistics.median(s) * 1e3 for name, s in seconds.items()}
    c["stacked_vs_one_by_one"] = c["stacked_ms"] / c["one_by_one_ms"]
    c["pair_ratios"] = [s / o for s, o in zip(seconds["stacked"], seconds["one_by_one"])]
    return c


if __name__ == "__main__":
    sys.exit(main())
