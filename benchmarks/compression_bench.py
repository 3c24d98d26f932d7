"""Update compression over real gRPC: upload bytes per round and final test accuracy, per method.

Each row is a whole `fedpar simulate` run (real coordinator, real agents in worker processes, loopback gRPC)
on the bundled digits data; bytes are what the coordinator accepted (encoded tensor bytes), per round.
One command:  .venv/bin/python benchmarks/compression_bench.py   (--quick: 3 rounds, 2 methods less)
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np

from fedpar.cli.argtypes import FedparParser
from fedpar.protocol.compressed_wire import CompressionConfig
from fedpar.simulations.runner import SimulationConfig, run_simulation

METHODS = [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("topk", {"topk_ratio": 0.1}),
           ("topk", {"topk_ratio": 0.01})]  # CompressionConfig's knobs


def run_method(method: str, knobs: dict, args: argparse.Namespace, seed: int) -> dict:
    """One simulation with ``method``; its per-round upload bytes and accuracy."""
    cfg = SimulationConfig(clients=args.clients, rounds=args.rounds, dataset="digits", partition=args.partition,
                           upload_compression=CompressionConfig(method, **knobs), workers=args.workers, seed=seed)
    started = time.monotonic()
    summary = run_simulation(cfg)
    return {"bytes": summary["mean_upload_bytes_per_round"], "final": summary["final_test_accuracy"],
            "best": summary["best_test_accuracy"], "failed": summary["failed_rounds"],
            "seconds": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    """Run every method and print the table as rows finish."""
    ap = FedparParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10, help="simulated agents (all report every round)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per run")
    ap.add_argument("--partition", default="iid", help="iid, dirichlet:ALPHA or shards:N")
    ap.add_argument("--seeds", type=int, default=1, help="runs per method (seeds 0..N-1), accuracy averaged")
    ap.add_argument("--workers", type=int, default=2, help="agent processes per run")
    ap.add_argument("--quick", action="store_true", help="3 rounds; none, int8 and topk 0.01 only")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "compression_bench.json",
                    help="where the rows go (--quick: under runs/benchmarks/, as every benchmark's smoke run)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    methods = METHODS
    if args.quick:
        args.rounds = 3
        methods = [m for m in METHODS if m[0] in ("none", "int8") or m[1].get("topk_ratio") == 0.01]
    print(f"Update compression over real gRPC: digits, MLP, {args.clients} clients x {args.rounds} rounds "
          f"({args.partition}, E=5, lr 0.1), {args.seeds} seed(s); bytes = encoded upload bytes per round "
          "accepted at the coordinator")
    print(f"{'method':<12} {'bytes/round':>12} {'vs none':>8} {'final acc':>10} {'best acc':>9} "
          f"{'failed':>6} {'s/run':>6}", flush=True)
    rows, base = [], None
    for method, knobs in methods:
        runs = [run_method(method, knobs, args, seed) for seed in range(args.seeds)]
        row = {"method": method, **knobs, "bytes_per_round": runs[0]["bytes"],
               "final_accuracy": float(np.mean([r["final"] for r in runs])),
               "best_accuracy": float(np.mean([r["best"] for r in runs])),
               "failed_rounds": sum(r["failed"] for r in runs),
               "seconds_per_run": float(np.mean([r["seconds"] for r in runs]))}
        base = base or (row["bytes_per_round"] if method == "none" else None)
        label = method + (f" {knobs['topk_ratio']:g}" if "topk_ratio" in knobs else "")
        ratio = f"{base / row['bytes_per_round']:7.1f}x" if base else "-"
        print(f"{label:<12} {row['bytes_per_round']:12,.0f} {ratio:>8} {row['final_accuracy']:10.4f} "
              f"{row['best_accuracy']:9.4f} {row['failed_rounds']:6d} {row['seconds_per_run']:6.1f}", flush=True)
        rows.append(row)
    from results import write_results

    ratios = [{"what": f"upload bytes per round, {r['method']}" + (f" {r['topk_ratio']:g}" if "topk_ratio" in r
                                                                  else ""),
               "ratio": r["bytes_per_round"] / base, "against": "no compression, same run"}
              for r in rows if base and r["method"] != "none"]
    print(f"wrote {write_results(args.json, ratios, rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
