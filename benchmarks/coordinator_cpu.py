"""The coordinator's CPU per round in issue 25's hardest steady cell (digits MLP, one local epoch, 10 of 100 clients),
read from /proc: the `fedpar simulate` process itself (its event loop, gRPC and helper threads; the workers are its
children, counted apart), over rounds ``--from``..``--to`` of one run.

One command: ``.venv/bin/python benchmarks/coordinator_cpu.py [--baseline PYTHON] [--pairs 5]``. With ``--baseline``
(another checkout's venv python, e.g. main's) it alternates baseline and this checkout's runs, pair by pair, so both
see the same load, and prints each one's median coordinator ms of CPU per round and their ratio. CPU time, not wall
time: on a loaded 2-core machine a round's wall time says little. Writes benchmarks/results/coordinator_cpu.json
(``--json``).
"""

from __future__ import annotations

import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results import write_results  # noqa: E402  (benchmarks/, this script's folder)

from fedpar.cli.argtypes import FedparParser  # noqa: E402

CELL = ["--dataset", "digits", "--model", "mlp", "--local-epochs", "1", "--clients", "100", "--clients-per-round", "10"]
TICK = os.sysconf("SC_CLK_TCK")


def _cpu(stat: str) -> int:
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks


def thread_ticks(pid: int) -> dict[str, tuple[str, int]]:
    """Each thread of ``pid``: (its name, its CPU ticks so far)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # it ended meanwhile
        out[tid] = (stat[stat.index("(") + 1:stat.rindex(")")], _cpu(stat))
    return out


def children_ticks(pid: int) -> int:
    """CPU ticks so far of ``pid``'s child processes (the workers)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
            total += sum(_cpu(Path(f"/proc/{k}/stat").read_text()) for k in kids)
        except OSError:
            continue
    return total


def measure(python: str, first: int, last: int) -> dict:
    """One `fedpar simulate` run of the cell with ``python``: CPU ms per round of the coordinator process (and per
    thread name) and of the workers, over rounds ``first``..``last``, with the load average."""
    out = Path(tempfile.mkdtemp())
    proc = subprocess.Popen([python, "-m", "fedpar", "simulate", *CELL, "--rounds", str(last + 3), "--out", str(out),
                             "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, marks = out / "metrics.jsonl", []
    try:
        while proc.poll() is None and len(marks) < 2:
            rows = metrics.read_text().count("\n") if metrics.exists() else 0
            if rows >= (first, last)[len(marks)]:
                marks.append((time.monotonic(), thread_ticks(proc.pid), children_ticks(proc.pid), os.getloadavg()[0]))
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait()
    if len(marks) < 2:
        raise RuntimeError(f"simulate with {python} ended before round {last}")
    (t0, threads0, kids0, load0), (t1, threads1, kids1, load1) = marks
    rounds = last - first
    by_name = collections.Counter()
    for tid, (name, ticks) in threads1.items():
        by_name[name] += ticks - threads0.get(tid, (name, 0))[1]
    ms = 1000 / TICK / rounds
    return {"coordinator_ms": sum(by_name.values()) * ms, "workers_ms": (kids1 - kids0) * ms,
            "wall_ms": 1000 * (t1 - t0) / rounds, "load": (load0 + load1) / 2,
            "threads_ms": {name: ticks * ms for name, ticks in by_name.most_common() if ticks}}


def main() -> None:
    parser = FedparParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another checkout's python to alternate with (e.g. main's venv)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--from", dest="first", type=int, default=20, help="first round of the window")
    parser.add_argument("--to", dest="last", type=int, default=420, help="last round of the window")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "coordinator_cpu.json", help="where it goes")
    args = parser.parse_args()
    kinds = {"this": sys.executable} | ({"baseline": args.baseline} if args.baseline else {})
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for pair in range(args.pairs):
        for kind in (["baseline", "this"] if args.baseline else ["this"]):
            runs[kind].append(measure(kinds[kind], args.first, args.last))
            r = runs[kind][-1]
            print(f"pair {pair + 1} {kind:<8} coordinator {r['coordinator_ms']:5.2f} ms/round  workers "
                  f"{r['workers_ms']:5.2f}  wall {r['wall_ms']:5.1f}  load {r['load']:.1f}", flush=True)
    medians = {k: statistics.median(r["coordinator_ms"] for r in v) for k, v in runs.items()}
    ratios = []
    for kind, median in medians.items():
        print(f"{kind}: median coordinator CPU {median:.2f} ms per round")
    if args.baseline:
        ratio = medians["this"] / medians["baseline"]
        print(f"this / baseline: {ratio:.3f}")
        ratios.append({"what": "coordinator CPU per round, 10 of 100 clients (median of alternated runs)",
                       "ratio": ratio, "against": "the baseline checkout in the same run"})
    path = write_results(args.json, ratios,
                         {"cell": CELL, "window": [args.first, args.last], "medians_ms": medians, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
