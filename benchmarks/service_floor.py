"""What a steady round of `fedpar simulate` costs with no training at all: the service's own floor, against the plain
PyTorch loop's whole round (fedavg_floor.py), measured in the same run.

One command: ``.venv/bin/python benchmarks/service_floor.py`` (``--pairs 5``, ``--rounds 61``; the cell: issue 25's
10 of 100, digits MLP, one local epoch, default flags otherwise; ``--clients-per-round 100`` for 100 of 100).

Each pair runs, alternated (which goes first too):
- `fedpar simulate` with default flags (the zoo's digits MLP: sample, deliver, train, evaluate, upload, fold);
- the same with ``--task benchmarks/service_floor.py:untrained``, ``--client-eval-every 0`` and ``--seats 1`` (the
  default route's seats here): the same model, data, cohorts and service, whose members train no step and score nothing (their train hook returns at once with their
  example count), so every millisecond left is the service's: sampling, the tasks' delivery, the members' data and
  weights, the uploads, their checks and fold, the central evaluation and the metrics row;
then the plain loop once (the same cohorts trained and evaluated in one process, no service). Each simulate figure is
its steady period (the median of the seconds from one metrics row to the next, rounds 2..R). It prints each pair,
their medians, and both against the plain loop's round: the untrained one is what no change to local training can
go below. Results: benchmarks/results/service_floor.json (``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path

from fedpar.cli.argtypes import FedparParser

HERE = Path(__file__).resolve().parent


def _train_nothing(model, data, config, deadline) -> tuple[int, dict]:
    """A train hook that takes no step: the member reports its examples and leaves its weights as received."""
    return len(data.train), {}


def untrained():
    """The zoo's digits MLP task (the default `fedpar simulate` job's) whose members train no step."""
    from fedpar.tasks.zoo import classifier
    return dataclasses.replace(classifier("mlp", "digits"), train=_train_nothing, name="untrained mlp on digits")


def simulate_ways(clients: int, per_round: int, rounds: int) -> tuple[list[str], dict[str, list[str]]]:
    """The default job's `fedpar simulate` flags (the plain loop's too) and each way's: default and untrained."""
    shape = ["--local-epochs", "1", "--clients", str(clients), "--clients-per-round", str(per_round),
             "--rounds", str(rounds)]
    job = ["--dataset", "digits", "--model", "mlp", *shape]
    # the task brings its model and data (simulate refuses --dataset and --model beside it); --seats 1: the default
    # route's seats here (a --task gets 4 for its own data loading, which this one does not do)
    return job, {"default": job, "untrained": [*shape, "--task", f"{Path(__file__).resolve()}:untrained",
                                               "--client-eval-every", "0", "--seats", "1"]}


def main() -> int:
    """Run the pairs and the plain loop, print and write the figures."""
    sys.path.insert(0, str(HERE))
    from population_bench import run_floor, run_simulate
    from results import write_results

    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=61)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--clients-per-round", type=int, default=10)
    p.add_argument("--json", type=Path, default=HERE / "results" / "service_floor.json")
    a = p.parse_args()
    job, ways = simulate_ways(a.clients, a.clients_per_round, a.rounds)
    print(f"load average before: {os.getloadavg()[0]:.2f}; {a.clients_per_round} of {a.clients}, {a.pairs} pairs")
    periods: dict[str, list[float]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(a.pairs):
            for name in ways if n % 2 == 0 else reversed(ways):
                periods[name].append(run_simulate(ways[name], Path(tmp) / f"{name}-{n}")["steady_period_seconds"])
            print(f"pair {n + 1}: default {periods['default'][-1] * 1e3:.1f} ms, untrained "
                  f"{periods['untrained'][-1] * 1e3:.1f} ms (load {os.getloadavg()[0]:.1f})", flush=True)
    plain = run_floor(job)["steady_round_seconds"]
    medians = {name: statistics.median(v) for name, v in periods.items()}
    print(f"plain loop {plain * 1e3:.2f} ms a round; default {medians['default'] * 1e3:.2f} ms "
          f"({medians['default'] / plain:.2f}x); untrained {medians['untrained'] * 1e3:.2f} ms "
          f"({medians['untrained'] / plain:.2f}x): the service's own share of a default round "
          f"{medians['untrained'] / medians['default']:.0%}")
    cell = f"{a.clients_per_round} of {a.clients}, digits MLP, median of {a.pairs} runs, load {os.getloadavg()[0]:.1f}"
    ratios = [{"what": f"steady round of fedpar simulate, default flags ({cell})", "ratio": medians["default"] / plain,
               "against": "the same rounds in one plain PyTorch loop (fedavg_floor.py), same run"},
              {"what": f"steady round of fedpar simulate whose members train no step and score nothing ({cell})",
               "ratio": medians["untrained"] / plain,
               "against": "the plain loop's whole round (training and central evaluation), same run"}]
    path = write_results(a.json, ratios, {"args": job, "periods_seconds": periods, "medians_seconds": medians,
                                          "plain_round_seconds": plain})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

