"""A worker's members of a round trained stacked (client/batched_trainer.py) against one by one (the local loop of
each member's own trainer), in thread CPU time, so that other work on the machine costs neither way much: the
training alone, none of the round's service around it.

Digits MLP, one epoch, batch 32, the steady-round cells' shapes per worker: 5 members of 13 examples (10 of 100 on
2 workers: one step each), 5 of 130 (10 of 10) and 50 of 13 (100 of 100); median of ``--repeats`` runs of each
way, alternated, one torch thread. Writes benchmarks/results/stacked_cpu_bench.json.
"""

from __future__ import annotations

import argparse
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

from fedpar.client.batched_trainer import ClientBatchInput, member_tensors, train_clients_batched  # noqa: E402
from fedpar.client.trainer import LocalTrainer  # noqa: E402
from fedpar.datasets import load_dataset  # noqa: E402
from fedpar.models.for_data import build_model_for_data  # noqa: E402

CELLS = ((5, 13, "10 of 100"), (5, 130, "10 of 10"), (50, 13, "100 of 100"))  # members, examples each, the cell
BATCH, LR, ROUND = 32, 0.05, 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30, help="runs of each way, alternated")
    a = p.parse_args()
    torch.set_num_threads(1)
    splits = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"digits MLP, E1, B{BATCH}; thread CPU ms; load average {' '.join(load)}")
    print(f"{'cell':>12}{'members':>8}{'each':>6}{'stacked':>9}{'one by one':>11}{'ratio':>7}")
    cells, ratios = [], []
    for k, size, cell in CELLS:
        subsets = [splits.train.subset(np.arange(j * size, (j + 1) * size) % len(splits.train)) for j in range(k)]
        tensors = [member_tensors(s) for s in subsets]
        alone = [LocalTrainer(copy.deepcopy(model), s, seed=j) for j, s in enumerate(subsets)]

        def stacked():
            train_clients_batched(model, [ClientBatchInput(x, y, seed=j) for j, (x, y) in enumerate(tensors)],
                                  1, BATCH, LR, ROUND)

        def one_by_one():
            for trainer in alone:
                trainer.train(1, BATCH, LR, round_id=ROUND)

        ways = {"stacked": stacked, "one_by_one": one_by_one}
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for fn in ways.values():
            fn()  # first-call set-up (torch.func's) is not a round's
        for _ in range(a.repeats):
            for name, fn in ways.items():
                start = time.thread_time()
                fn()
                seconds[name].append(time.thread_time() - start)
        c = {"cell": cell, "members": k, "examples_each": size, "load_average": load,
             **{f"{name}_ms": statistics.median(s) * 1e3 for name, s in seconds.items()}}
        c["stacked_vs_one_by_one"] = c["stacked_ms"] / c["one_by_one_ms"]
        cells.append(c)
        print(f"{cell:>12}{k:>8}{size:>6}{c['stacked_ms']:>9.2f}{c['one_by_one_ms']:>11.2f}"
              f"{c['stacked_vs_one_by_one']:>7.2f}")
        ratios.append({"what": f"{k} digits-MLP members of {size} examples trained stacked, E1 B{BATCH}, thread CPU "
                               f"time ({cell} on 2 workers; load {' '.join(load)})",
                       "ratio": c["stacked_vs_one_by_one"], "against": "the same members one by one, same run"})
    path = write_results(HERE / "results" / "stacked_cpu_bench.json", ratios, {"repeats": a.repeats, "cells": cells})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
