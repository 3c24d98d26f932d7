"""What a small `fedpar simulate` costs to start its worker processes: forked from the command's process once it has
imported their modules (fedpar's way where it may fork, simulations/worker_processes.py start_method) against each
worker spawned and importing torch, gRPC and the client runtime itself, measured in the same run; and, in a process
that may not fork (it has served gRPC, as a notebook that ran a simulation has, or a test), several simulations in a
row with their workers forked from multiprocessing's fork server (fedpar's way there) against spawned.

    .venv/bin/python benchmarks/worker_start_bench.py            # digits, 10 clients, 2 rounds, 2 workers, 5 runs each
    .venv/bin/python benchmarks/worker_start_bench.py --workers 4 --repeats 3

Each run is a whole process tree: the CPU seconds of every process in it (this script is their subreaper, so any
that outlive their parent by a moment are reaped and counted here) and its wall seconds, medians over the repeats,
runs of each pair's two kinds taking turns.
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

# A process that has served gRPC (so it may not fork) running ``--in-a-row`` simulations, one after another; "spawn"
# as its first argument spawns their workers instead of forking them from the fork server.
IN_A_ROW = """
import sys
import grpc
server = grpc.server(None, handlers=[])
server.add_insecure_port("127.0.0.1:0")
server.start()
server.stop(0).wait()
from fedpar.simulations import worker_processes
if sys.argv[1] == "spawn":
    worker_processes.start_method = lambda: "spawn"
from fedpar.cli.main import main
for run in range(int(sys.argv[2])):
    assert main([*sys.argv[4:], "--out", f"{sys.argv[3]}/{run}"]) == 0
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


def measure(command: list[str], out: Path, out_flag: bool = True) -> dict:
    """One run of ``command`` (a whole simulate, into ``out``; ``out_flag`` False: ``command`` names it already): its
    tree's CPU seconds and its wall seconds."""
    cpu, started = _cpu_of_children(), time.monotonic()
    done = subprocess.run(command + (["--out", str(out)] if out_flag else []), capture_output=True, text=True)
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
    p.add_argument("--in-a-row", type=int, default=3, help="simulations one process runs after it served gRPC")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "worker_start_bench.json",
                   help="where the figures go")
    args = p.parse_args(argv)
    ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the whole tree is reaped here
    flags = ["simulate", "--dataset", "digits", "--clients", str(args.clients), "--rounds", str(args.rounds),
             "--workers", str(args.workers), "--quiet"]
    in_a_row = [str(args.in_a_row)]
    kinds = {"forked": [sys.executable, "-m", "fedpar", *flags],
             "spawned (baseline)": [sys.executable, "-c", SPAWNED, *flags],
             f"{args.in_a_row} in a row, fork server": [sys.executable, "-c", IN_A_ROW, "forkserver", *in_a_row],
             f"{args.in_a_row} in a row, spawned (baseline)": [sys.executable, "-c", IN_A_ROW, "spawn", *in_a_row]}
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for kind, command in kinds.items():
                out = Path(scratch) / f"{repeat}-{len(runs[kind])}-{kind.replace(' ', '-')}"
                if "in a row" in kind:  # the script takes the folder of its runs before the command's flags
                    runs[kind].append(measure(command + [str(out), *flags], out, out_flag=False))
                else:
                    runs[kind].append(measure(command, out))
    medians = {kind: {key: statistics.median(r[key] for r in rows) for key in ("cpu_seconds", "wall_seconds")}
               for kind, rows in runs.items()}
    print(f"{'workers start':<40}{'CPU s':>8}{'wall s':>8}")
    for kind, m in medians.items():
        print(f"{kind:<40}{m['cpu_seconds']:>8.2f}{m['wall_seconds']:>8.2f}")
    what = f"simulate, digits, {args.clients} clients, {args.rounds} rounds, {args.workers} workers"
    row = f"{args.in_a_row} such simulations in one process that has served gRPC"
    ratios = []
    for mine, base, said, against in (
            ("forked", "spawned (baseline)", what + ", workers forked", "the same command, workers spawned"),
            (f"{args.in_a_row} in a row, fork server", f"{args.in_a_row} in a row, spawned (baseline)",
             row + ", workers forked from the fork server", "the same runs, workers spawned")):
        ratios += [{"what": f"{said}: CPU seconds of the whole process tree", "ratio":
                    medians[mine]["cpu_seconds"] / medians[base]["cpu_seconds"], "against": against},
                   {"what": f"{said}: wall seconds", "ratio": medians[mine]["wall_seconds"] /
                    medians[base]["wall_seconds"], "against": against}]
    for r in ratios:
        print(f"{r['ratio']:.2f}x  {r['what']} (against {r['against']})")
    print(f"wrote {write_results(args.json, ratios, {'runs': runs, 'medians': medians, 'load_average': os.getloadavg()})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
