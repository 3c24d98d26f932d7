"""What a small `fedpar simulate` costs to start its worker processes: forked from the command's process once it has
imported their modules (fedpar's way where it may fork, simulations/worker_processes.py start_method) against each
worker spawned and importing torch, gRPC and the client runtime itself, measured in the same run.

    .venv/bin/python benchmarks/worker_start_bench.py            # digits, 10 clients, 2 rounds, 2 workers, 5 runs each
    .venv/bin/python benchmarks/worker_start_bench.py --workers 4 --repeats 3

Each run is a whole `fedpar simulate` process tree: the CPU seconds of every process in it (this script is their
subreaper, so any that outlive their parent by a moment are reaped and counted here) and its wall seconds, medians
over the repeats, runs of the two kinds taking turns.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import write_results  # benchmarks/, this script's folder

from fedpar.cli.argtypes import FedparParser

# The baseline: the same command with its workers spawned (as fedpar starts them where it may not fork).
SPAWNED = """
import sys
from fedpar.simulations import worker_processes
worker_processes.start_method = lambda: "spawn"
from fedpar.cli.entry import entry
sys.argv = ["fedpar", *sys.argv[1:]]
entry()
"""


def _reap_all() -> None:
    """Wait for every process left below this one (orphans come here: this process is their subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(command: list[str], out: Path) -> dict:
    """One run of ``command`` (a whole simulate, into ``out``): its tree's CPU seconds and its wall seconds."""
    cpu, started = _cpu_of_children(), time.monotonic()
    done = subprocess.run(command + ["--out", str(out)], capture_output=True, text=True)
    wall = time.monotonic() - started
    _reap_all()
    if done.returncode != 0:
        raise SystemExit(f"worker_start_bench: {' '.join(command)} failed: {done.stderr.strip()}")
    return {"cpu_seconds": _cpu_of_children() - cpu, "wall_seconds": wall}


def main(argv: list[str] | None = None) -> int:
    """Run both kinds in turn and print their medians and ratios."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=10, help="the population (all sampled each round)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per run")
    p.add_argument("--workers", type=int, default=2, help="worker processes per run")
    p.add_argument("--repeats", type=int, default=5, help="runs of each kind")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "worker_start_bench.json",
                   help="where the figures go")
    args = p.parse_args(argv)
    ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the whole tree is reaped here
    flags = ["simulate", "--dataset", "digits", "--clients", str(args.clients), "--rounds", str(args.rounds),
             "--workers", str(args.workers), "--quiet"]
    kinds = {"forked": [sys.executable, "-m", "fedpar", *flags],
             "spawned (baseline)": [sys.executable, "-c", SPAWNED, *flags]}
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for kind, command in kinds.items():
                runs[kind].append(measure(command, Path(scratch) / f"{repeat}-{len(runs[kind])}-{kind[:5]}"))
    medians = {kind: {key: statistics.median(r[key] for r in rows) for key in ("cpu_seconds", "wall_seconds")}
               for kind, rows in runs.items()}
    forked, spawned = medians["forked"], medians["spawned (baseline)"]
    print(f"{'workers start':<30}{'CPU s':>8}{'wall s':>8}")
    for kind, m in medians.items():
        print(f"{kind:<30}{m['cpu_seconds']:>8.2f}{m['wall_seconds']:>8.2f}")
    what = f"simulate, digits, {args.clients} clients, {args.rounds} rounds, {args.workers} workers"
    ratios = [{"what": f"{what}: CPU seconds of the whole process tree, workers forked", "ratio":
               forked["cpu_seconds"] / spawned["cpu_seconds"], "against": "the same command, workers spawned"},
              {"what": f"{what}: wall seconds, workers forked", "ratio": forked["wall_seconds"] /
               spawned["wall_seconds"], "against": "the same command, workers spawned"}]
    for r in ratios:
        print(f"{r['ratio']:.2f}x  {r['what']} (against {r['against']})")
    print(f"wrote {write_results(args.json, ratios, {'runs': runs, 'medians': medians, 'load_average': os.getloadavg()})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
