"""Steady rounds of `fedpar simulate`, this checkout against another one, alternated in pairs, and both against the
plain PyTorch loop (fedavg_floor.py) measured in the same run.

One command: ``.venv/bin/python benchmarks/steady_pairs.py --baseline OTHER/.venv/bin/python`` (a checkout of the
code to compare with, installed in its own venv: ``git worktree add /tmp/base REV``, then ``python -m venv
/tmp/base/.venv`` and ``pip install torch==2.13.0 numpy`` and ``pip install -e /tmp/base`` in it).

For each cell it runs ``--pairs`` pairs, this checkout's `fedpar simulate` then the baseline's (the same flags,
default ones otherwise), each its steady round: the median of the seconds from one metrics row to the next, rounds
2..R, as ``population_bench.py --steady`` measures it; then the plain loop once. It prints each pair, the median of
the pairs' ratios (this checkout over the baseline: below 1 is faster) and both medians over the plain loop's round,
with the load average. The cells: issue 25's three (digits MLP, one local epoch: 10 of 10, 100 of 100, 10 of 100);
with ``--cells "10 of 100 on 2 ranks"`` the 10-of-100 round on two aggregator ranks; and with ``--mnist-cnn`` the FedAvg paper's MNIST CNN round (10 of 100 clients, one local epoch, B10), whose central
evaluation scores 10,000 test images. Results: benchmarks/results/steady_pairs.json (``--json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from population_bench import run_floor, run_simulate  # noqa: E402  (benchmarks/, this script's folder)
from results import write_results  # noqa: E402

from fedpar.cli.argtypes import FedparParser  # noqa: E402

DIGITS = ["--dataset", "digits", "--model", "mlp", "--local-epochs", "1"]
CELLS = {"10 of 10": [*DIGITS, "--clients", "10", "--clients-per-round", "10"],
         "100 of 100": [*DIGITS, "--clients", "100", "--clients-per-round", "100"],
         "10 of 100": [*DIGITS, "--clients", "100", "--clients-per-round", "10"],
         "10 of 100 on 2 ranks": [*DIGITS, "--clients", "100", "--clients-per-round", "10", "--aggregator-ranks", "2"]}
ISSUE_25 = ["10 of 10", "100 of 100", "10 of 100"]  # the cells run by default


def mnist_cnn(mnist_dir: str) -> list[str]:
    """The FedAvg paper's MNIST CNN round: 10 of 100 clients, E1, B10 (its central evaluation: the 10,000 test
    images)."""
    return ["--dataset", "mnist", "--data-dir", mnist_dir, "--model", "cnn", "--clients", "100",
            "--clients-per-round", "10", "--local-epochs", "1", "--batch-size", "10"]


def load() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def floor_args(job: list[str]) -> list[str]:
    """``job``'s flags for the plain loop: the same training, without the service's own (aggregator ranks)."""
    if "--aggregator-ranks" not in job:
        return job
    at = job.index("--aggregator-ranks")
    return job[:at] + job[at + 2:]


def one_cell(name: str, args: list[str], rounds: int, pairs: int, baseline: str, tmp: Path) -> dict:
    """``pairs`` alternated runs of this checkout and ``baseline`` on ``args``, and the plain loop once."""
    job = [*args, "--rounds", str(rounds)]
    runs = []
    for n in range(pairs):
        this = run_simulate(job, tmp / f"{name}-this-{n}")["steady_period_seconds"]
        other = run_simulate(job, tmp / f"{name}-base-{n}", python=baseline)["steady_period_seconds"]
        runs.append({"this": this, "baseline": other, "ratio": this / other, "load": load()})
        print(f"{name:>11}  pair {n + 1}: {this * 1e3:8.1f} ms against {other * 1e3:8.1f} ms  "
              f"({this / other:.2f}, load {runs[-1]['load']:.1f})", flush=True)
    plain = run_floor(floor_args(job))["steady_round_seconds"]
    this = statistics.median(r["this"] for r in runs)
    other = statistics.median(r["baseline"] for r in runs)
    return {"cell": name, "args": job, "pairs": runs, "plain_round_seconds": plain,
            "this_round_seconds": this, "baseline_round_seconds": other,
            "vs_baseline": statistics.median(r["ratio"] for r in runs),
            "this_vs_plain": this / plain, "baseline_vs_plain": other / plain,
            "load": [min(r["load"] for r in runs), max(r["load"] for r in runs)]}


def ratios(cells: list[dict], label: str) -> list[dict]:
    """The results envelope's ratios: each cell against the baseline (pairs) and against the plain loop."""
    out = []
    for c in cells:
        spread = f"{min(r['ratio'] for r in c['pairs']):.2f}-{max(r['ratio'] for r in c['pairs']):.2f}"
        where = f"{c['cell']}, load {c['load'][0]:.1f}-{c['load'][1]:.1f}"
        out += [{"what": f"steady round of fedpar simulate, {where}: median of {len(c['pairs'])} pairs ({spread})",
                 "ratio": c["vs_baseline"], "against": f"{label}, run alternately on the same machine"},
                {"what": f"steady round of fedpar simulate, {where}: this checkout, median of {len(c['pairs'])} runs",
                 "ratio": c["this_vs_plain"], "against": "the same rounds in one plain PyTorch loop (fedavg_floor.py), "
                                                         "same run"},
                {"what": f"the same, {label}", "ratio": c["baseline_vs_plain"],
                 "against": "the same plain loop, same run"}]
    return out


def main() -> int:
    """Run the cells and write the JSON."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the python of a venv where the other checkout is installed")
    p.add_argument("--label", help="what the baseline is, for the JSON (default: its checkout's folder)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=31, help="rounds per run of the digits cells")
    p.add_argument("--cells", default=",".join(ISSUE_25), help=f"digits cells to run, of: {', '.join(CELLS)} "
                   "(none: '')")
    p.add_argument("--mnist-cnn", action="store_true", help="also the FedAvg paper's MNIST CNN round (6 rounds)")
    p.add_argument("--mnist-dir", default=str(HERE.parent.parent / "shared" / "data" / "mnist"))
    p.add_argument("--json", type=Path, default=HERE / "results" / "steady_pairs.json")
    a = p.parse_args()
    label = a.label or f"the checkout at {Path(a.baseline).absolute().parents[2]}"
    print(f"load average before: {os.getloadavg()[0]:.2f}; this checkout against {label}")
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in [c.strip() for c in a.cells.split(",") if c.strip()]:
            cells.append(one_cell(name, CELLS[name], a.rounds, a.pairs, a.baseline, Path(tmp)))
        if a.mnist_cnn:
            cells.append(one_cell("mnist CNN 10 of 100", mnist_cnn(a.mnist_dir), 6, a.pairs, a.baseline, Path(tmp)))
    print(f"{'cell':>20}{'this ms':>10}{'base ms':>10}{'vs base':>9}{'this x plain':>14}{'base x plain':>14}")
    for c in cells:
        print(f"{c['cell']:>20}{c['this_round_seconds'] * 1e3:>10.1f}{c['baseline_round_seconds'] * 1e3:>10.1f}"
              f"{c['vs_baseline']:>9.2f}{c['this_vs_plain']:>14.2f}{c['baseline_vs_plain']:>14.2f}")
    path = write_results(a.json, ratios(cells, label), {"baseline": label, "cells": cells})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
