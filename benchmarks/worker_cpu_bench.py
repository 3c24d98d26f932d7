"""CPU a simulation worker spends per steady round of `fedpar simulate` (issue 25's 10-of-100 cell: digits MLP, one
local epoch), this checkout's code against a baseline checkout's, alternated in pairs on the same machine.

One command: ``.venv/bin/python benchmarks/worker_cpu_bench.py --baseline /work/main`` (``--pairs 3``; any other
`fedpar simulate` flags after ``--``; ``--this-flags "--seats 1"``: flags for this checkout's runs only, e.g. to
compare a setting with ``--baseline .``). Each run is `fedpar simulate --quiet` started with its checkout's own venv
from its root; while it runs, the benchmark reads utime+stime of the worker processes (the simulate process's
children) from /proc/PID/stat and of each of their threads from /proc/PID/task/*/stat, once the metrics file holds
``--skip`` rows and again ``--window`` rows later, and divides by the rounds in between. Threads are grouped by the
name its Python thread has (``fedpar-seat*``, ``fedpar-host-uploads``...: a ``sitecustomize`` on PYTHONPATH, this
benchmark's only, gives each thread's OS name its Python name; a thread gone before the second read is in the
process total only). It also prints the round period (median gap between metrics rows in the window), the
load average before and after, and each figure's median over the pairs as a ratio to the baseline's.
The results go to benchmarks/results/worker_cpu_bench.json (``--json``).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from results import write_results  # noqa: E402  (benchmarks/, this script's folder)

from fedpar.cli.argtypes import FedparParser  # noqa: E402

HERE = Path(__file__).resolve().parent
TICK = os.sysconf("SC_CLK_TCK")
CELL = ["--dataset", "digits", "--model", "mlp", "--local-epochs", "1", "--clients", "100",
        "--clients-per-round", "10"]


NAMING = """import ctypes, threading
_libc = ctypes.CDLL(None)
_bootstrap = threading.Thread._bootstrap_inner
def _named(self):
    _libc.prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    _bootstrap(self)
threading.Thread._bootstrap_inner = _named
"""


def _stat_seconds(path: Path) -> float:
    """utime+stime of a /proc stat file, in seconds."""
    fields = path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _thread_group(tid_dir: Path) -> str:
    """A thread's group: its name without a trailing number."""
    try:
        name = tid_dir.joinpath("comm").read_text().strip()
    except OSError:
        return "?"
    return re.sub(r"\d+$", "", name)


def _sample(workers: list[int]) -> tuple[float, dict[tuple[int, str], float]]:
    """The workers' total CPU seconds, and per (tid, group) of their live threads."""
    total, threads = 0.0, {}
    for pid in workers:
        try:
            total += _stat_seconds(Path(f"/proc/{pid}/stat"))
            for tid in Path(f"/proc/{pid}/task").iterdir():
                threads[(int(tid.name), _thread_group(tid))] = _stat_seconds(tid / "stat")
        except OSError:
            continue
    return total, threads


def _rows(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def run(root: Path, simulate_args: list[str], skip: int, window: int) -> dict:
    """One run of the cell with ``root``'s code: per round, the workers' CPU ms (total and per thread group)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        Path(tmp, "sitecustomize.py").write_text(NAMING)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([str(root / ".venv/bin/python"), "-m", "fedpar", "simulate", *simulate_args,
                                 "--out", str(out), "--quiet"], cwd=root, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        samples = []
        try:
            for target in (skip, skip + window):
                while len(_rows(out / "metrics.jsonl")) < target:
                    if proc.poll() is not None:
                        raise RuntimeError(f"simulate ended early: {proc.stderr.read()[-2000:]}")
                    time.sleep(0.005)
                samples.append(_sample(_children(proc.pid)))
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        rows = _rows(out / "metrics.jsonl")[skip - 1:skip + window]
    (t0, th0), (t1, th1) = samples
    groups: dict[str, float] = defaultdict(float)
    for key, seconds in th1.items():
        groups[key[1]] += seconds - th0.get(key, 0.0)
    per_round = 1000.0 / window
    return {"worker_cpu_ms": (t1 - t0) * per_round,
            "threads_ms": {g: round(s * per_round, 3) for g, s in sorted(groups.items())},
            "period_ms": 1000 * statistics.median(b["wall_seconds"] - a["wall_seconds"] for a, b in zip(rows, rows[1:]))}


def main() -> int:
    p = FedparParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="the checkout to compare with (its .venv is used)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--skip", type=int, default=8, help="metrics rows before the window starts")
    p.add_argument("--this-flags", default="", help="simulate flags for this checkout's runs only (one string)")
    p.add_argument("--json", type=Path, default=HERE / "results" / "worker_cpu_bench.json")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    simulate_args = [*CELL, "--rounds", str(args.rounds), *extra]
    window = args.rounds - args.skip - 2
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    results: dict[str, list[dict]] = {"baseline": [], "this": []}
    for pair in range(args.pairs):
        for name, root in (("baseline", args.baseline.resolve()), ("this", HERE.parent)):
            r = run(root, simulate_args + (args.this_flags.split() if name == "this" else []), args.skip, window)
            results[name].append(r)
            print(f"pair {pair} {name:<8} worker CPU {r['worker_cpu_ms']:6.2f} ms/round  period "
                  f"{r['period_ms']:6.1f} ms  load {Path('/proc/loadavg').read_text().split()[0]}  "
                  f"{r['threads_ms']}", flush=True)
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    summary = {}
    for key in ("worker_cpu_ms", "period_ms"):
        base = statistics.median(r[key] for r in results["baseline"])
        mine = statistics.median(r[key] for r in results["this"])
        summary[key] = {"baseline": round(base, 3), "this": round(mine, 3), "ratio": round(mine / base, 3)}
        print(f"{key}: baseline {base:.2f}  this {mine:.2f}  ratio {mine / base:.3f}")
    groups = sorted({g for rs in results.values() for r in rs for g in r["threads_ms"]})
    summary["threads_ms"] = {g: {name: round(statistics.median(r["threads_ms"].get(g, 0.0) for r in rs), 3)
                                 for name, rs in results.items()} for g in groups}
    for g, v in summary["threads_ms"].items():
        print(f"  {g:<24} baseline {v['baseline']:7.3f}  this {v['this']:7.3f} ms/round (both workers)")
    print(f"load {load_before} -> {load_after}")
    ratios = [{"what": f"{key} of the workers (this checkout)", "ratio": summary[key]["ratio"],
               "against": f"the same cell from {args.baseline} in alternated runs"}
              for key in ("worker_cpu_ms", "period_ms")]
    write_results(args.json, ratios, {"simulate_args": simulate_args, "this_flags": args.this_flags, "window_rounds": window, "pairs": args.pairs,
                                      "load_before": load_before, "load_after": load_after, "summary": summary,
                                      "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
