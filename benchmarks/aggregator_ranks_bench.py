"""One round's ingest through 1, 2 (and 4) aggregator ranks: K agents upload a P-parameter float32 update.

Each cell runs the real `fedpar serve --model synthetic --aggregator-ranks R` and K non-training agents
(benchmarks/bench_agents.py: fedpar's own wire code, data plane included) in worker processes, then reads the
coordinator's metrics rows. Per rank count it prints the round seconds (download + upload + fold + all-reduce,
median over the rounds after the first), the upload GB/s, the all-reduce seconds, the scaling efficiency
against one rank measured in the same run (t1 / (R x tR)), each rank's fold seconds, folds (each a group of the
uploads that waited for it) and peak memory, and the cores each side had. One command:

    python benchmarks/aggregator_ranks_bench.py            # K=100 x P=10M, ranks 1 2 (4 with >= 8 cores)
    python benchmarks/aggregator_ranks_bench.py --quick    # K=20 x P=1M
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_agents import run_light_worker  # noqa: E402
from results import write_results  # noqa: E402

from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.protocol.codec import ModelLayout  # noqa: E402
from fedpar.server.assembly import synthetic_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_cell(ranks: int, params: int, agents: int, rounds: int, workers: int, out: Path) -> dict:
    """Serve ``rounds`` rounds on ``ranks`` ranks with ``agents`` light agents; the coordinator's metrics rows."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fedpar", "serve", "--insecure", "--model", "synthetic", "--params", str(params),
           "--aggregator-ranks", str(ranks), "--rounds", str(rounds), "--clients-per-round", str(agents),
           "--min-available", str(agents), "--overselect", "1.0", "--deadline", "600", "--port", "0",
           "--port-file", str(out / "port"), "--out", str(out), "--max-queued-uploads", str(max(64, agents))]
    with open(out / "serve.log", "w") as log:
        serve = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        while not (out / "port").exists():
            if serve.poll() is not None:
                raise RuntimeError((out / "serve.log").read_text()[-3000:])
            time.sleep(0.1)
        address = f"127.0.0.1:{int((out / 'port').read_text())}"
        names, arrays = synthetic_model(params)
        specs = ModelLayout.of_arrays(names, arrays).specs()
        ids = [f"bench-{i:04d}" for i in range(agents)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=run_light_worker, args=(address, specs, ids[w::workers], 1 << 20, w), daemon=True)
                 for w in range(workers)]
        for p in procs:
            p.start()
        if serve.wait(3600) != 0:
            raise RuntimeError((out / "serve.log").read_text()[-3000:])
        for p in procs:
            p.join(60)
    finally:
        if serve.poll() is None:
            serve.kill()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if any(r["status"] != "ok" or r["reported"] != agents for r in rows):
        raise RuntimeError(f"a round did not complete with every agent: {rows}")
    return {"rows": rows, "model_bytes": sum(a.nbytes for a in arrays)}


def summarize(ranks: int, cell: dict, agents: int) -> dict:
    """Round seconds, GB/s, all-reduce seconds and per-rank fold seconds / peak memory (rounds after the first)."""
    rows = cell["rows"][1:] or cell["rows"]
    seconds = statistics.median(r["round_seconds"] for r in rows)
    per_rank = [{"uploads": statistics.median(r.get(f"r{k}_uploads", r["reported"]) for r in rows),
                 "fold_s": statistics.median(r.get(f"r{k}_fold_s", 0.0) for r in rows),
                 "folds": statistics.median(r.get(f"r{k}_fold_groups", 0.0) for r in rows),
                 "largest_fold": max(r.get(f"r{k}_fold_group_max", 0.0) for r in rows),
                 "peak_mib": max(r.get(f"r{k}_peak_mib", 0.0) for r in rows)} for k in range(ranks)]
    return {"ranks": ranks, "round_seconds": seconds,
            "upload_gbps": agents * cell["model_bytes"] / seconds / 1e9,
            "allreduce_s": statistics.median(r.get("allreduce_s", 0.0) for r in rows), "per_rank": per_rank}


def main() -> None:
    """Run the cells and print the table (and JSON)."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=10_000_000)
    p.add_argument("--agents", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, nargs="+")
    p.add_argument("--workers", type=int, default=2, help="agent processes")
    p.add_argument("--quick", action="store_true", help="K=20 x P=1M, 2 rounds")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/aggregator_ranks_bench.json"))
    args = p.parse_args()
    if args.quick:
        args.params, args.agents, args.rounds = 1_000_000, 20, 2
    cores = os.cpu_count() or 1
    ranks = args.ranks or ([1, 2, 4] if cores >= 8 else [1, 2])
    print(f"K={args.agents} agents x P={args.params:,} float32 ({4 * args.params / 1e6:.0f} MB each), "
          f"{args.rounds} rounds; {cores} cores shared by {args.workers} agent processes and the ranks")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in ranks:
            cell = run_cell(r, args.params, args.agents, args.rounds, args.workers, Path(tmp) / f"r{r}")
            results.append(summarize(r, cell, args.agents))
    base = results[0]["round_seconds"]
    print(f"{'ranks':>5} {'round s':>9} {'upload GB/s':>12} {'all-reduce s':>13} {'speed-up':>9} {'efficiency':>11}"
          "   per rank: uploads / fold s / folds (most updates in one) / peak MiB")
    for res in results:
        speedup = base / res["round_seconds"]
        res["speedup"], res["efficiency"] = speedup, speedup / res["ranks"]
        ranks_text = "  ".join(f"{x['uploads']:.0f}/{x['fold_s']:.2f}/{x['folds']:.0f} ({x['largest_fold']:.0f})/"
                               f"{x['peak_mib']:.0f}" for x in res["per_rank"])
        print(f"{res['ranks']:>5} {res['round_seconds']:>9.2f} {res['upload_gbps']:>12.2f} {res['allreduce_s']:>13.3f} "
              f"{speedup:>9.2f} {res['efficiency']:>11.2f}   {ranks_text}")
    ratios = [{"what": f"round time, {res['ranks']} aggregator ranks", "ratio": 1 / res["speedup"],
               "against": "one rank, same run"} for res in results[1:]]
    path = write_results(args.json, ratios, {"params": args.params, "agents": args.agents, "cores": cores,
                                             "agent_processes": args.workers, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
