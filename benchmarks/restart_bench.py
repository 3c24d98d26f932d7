"""Crash-restart cost of the coordinator: `kill -9` mid-round, restart, time to the next completed round.

One command prints a table next to the steady-state round time measured in the same run:

    .venv/bin/python benchmarks/restart_bench.py            # 1M parameters, 10 agents, 3 kills
    .venv/bin/python benchmarks/restart_bench.py --params 100000 --agents 50 --kills 2

The coordinator is `tests/support/synthetic_coordinator.py` (the real Coordinator and gRPC
server with a synthetic float32 model, checkpointing every round); the agents are members of one client runtime
(tests/support/synthetic_members.py, members that add noise instead of training) that re-joins by itself after
the restart.
"Restart" is measured from the new process's start, so it includes interpreter and library imports,
loading and validating the checkpoint, binding the port, the agents noticing and re-joining, and the
whole re-run round.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import write_results  # benchmarks/, this script's folder

from fedpar.cli.argtypes import FedparParser

MEMBERS = Path(__file__).resolve().parents[1] / "tests" / "support" / "synthetic_members.py"
COORDINATOR = MEMBERS.parent / "synthetic_coordinator.py"


def _rows(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def _wait(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise TimeoutError(what)


class Bench:
    """One coordinator (restartable) plus one process of members, sharing a checkpoint directory."""

    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.metrics = work / "metrics.jsonl"
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.completions: dict[int, float] = {}  # round -> wall time its metrics line appeared

    def start_coordinator(self) -> tuple[float, float]:
        """(process start time, time the port file appeared)."""
        port_file = self.work / "port"
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, str(COORDINATOR), "--params", str(self.args.params),
               "--agents", str(self.args.agents), "--rounds", str(self.args.rounds), "--deadline", "120",
               "--port", str(self.port), "--port-file", str(port_file), "--checkpoint-dir", str(self.work / "ckpt"),
               "--metrics", str(self.metrics), "--linger", "2"]
        started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.work / "coordinator.log", "a"))
        _wait(lambda: port_file.exists() or self.proc.poll() is not None, 120, "coordinator did not start")
        if self.proc.poll() is not None:
            raise RuntimeError((self.work / "coordinator.log").read_text()[-2000:])
        listening = time.time()
        self.port = int(port_file.read_text())
        return started, listening

    def watch(self, round_id: int, timeout: float = 300) -> float:
        """Wall time at which round ``round_id``'s metrics line was first seen."""
        def seen():
            for row in _rows(self.metrics):
                self.completions.setdefault(row["round"], time.time())
            return self.completions.get(round_id)
        return _wait(seen, timeout, f"round {round_id} did not complete")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=1_000_000, help="model size in float32 parameters")
    p.add_argument("--agents", type=int, default=10, help="members hosted (all of them report every round)")
    p.add_argument("--kills", type=int, default=3, help="kill -9 / restart cycles")
    p.add_argument("--warmup", type=int, default=3, help="rounds before the first kill")
    p.add_argument("--gap", type=int, default=2, help="undisturbed rounds between kills")
    p.add_argument("--delay", type=float, default=0.05, help="seconds into the next round at which to kill")
    p.add_argument("--quick", action="store_true", help="smoke run: 100k parameters, 1 kill after 2 rounds")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/restart_bench.json"),
                   help="where to write the ratios and raw figures")
    args = p.parse_args(argv)
    if args.quick:
        args.params, args.kills, args.warmup = 100_000, 1, 2
    args.rounds = args.warmup + args.kills * args.gap + 1
    work = Path(tempfile.mkdtemp(prefix="fedpar-restart-bench-"))
    bench = Bench(args, work)
    bench.start_coordinator()
    members = subprocess.Popen([sys.executable, str(MEMBERS), "--server", f"127.0.0.1:{bench.port}", "--count",
                                str(args.agents), "--params", str(args.params), "--poll", "5", "--max-backoff", "0.5"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    restarts = []
    try:
        bench.watch(args.warmup)
        for k in range(args.kills):
            last = args.warmup + k * args.gap
            bench.watch(last)
            time.sleep(args.delay)  # the next round is under way: tasks out, updates arriving
            os.kill(bench.proc.pid, signal.SIGKILL)
            bench.proc.wait()
            completed = max(r["round"] for r in _rows(bench.metrics))
            started, listening = bench.start_coordinator()
            done = bench.watch(completed + 1)
            restarts.append({"after_round": completed, "mid_round": completed == last,
                             "listening": listening - started, "next_round": done - started})
            bench.watch(last + args.gap)
        bench.watch(args.rounds)
        stats = json.loads(members.communicate(timeout=120)[0])
        bench.proc.wait(30)
    finally:
        for proc in (members, bench.proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
    rows = _rows(bench.metrics)
    assert [r["round"] for r in rows] == list(range(1, args.rounds + 1)), "rounds missing or repeated"
    # Steady state: the time between consecutive completions of undisturbed rounds (checkpoint included).
    disturbed = {r["after_round"] + 1 for r in restarts}
    gaps = [bench.completions[r] - bench.completions[r - 1] for r in range(2, args.rounds + 1)
            if r not in disturbed and r - 1 in bench.completions and r in bench.completions]
    steady = statistics.median(gaps)
    round_seconds = statistics.median(r["round_seconds"] for r in rows if r["round"] not in disturbed)
    print(f"\ncoordinator restart after kill -9 ({args.params:,} float32 parameters, {args.agents} agents, "
          f"checkpoint every round; agents reconnected {stats['reconnects']} times)\n")
    print(f"{'measurement':<44}{'seconds':>10}")
    print("-" * 54)
    print(f"{'steady-state round, completion to completion':<44}{steady:>10.3f}")
    print(f"{'steady-state round, dispatch to aggregate':<44}{round_seconds:>10.3f}")
    for r in restarts:
        where = "mid-round" if r["mid_round"] else "between rounds"
        label = f"restart after round {r['after_round']} ({where}): listening"
        print(f"{label:<44}{r['listening']:>10.3f}")
        print(f"{'   ... to the next completed round':<44}{r['next_round']:>10.3f}")
    med = statistics.median(r["next_round"] for r in restarts)
    print(f"\nmedian restart-to-next-round {med:.3f} s = {med / steady:.1f} x a steady-state round "
          f"(all {args.rounds} rounds completed exactly once; work dir {work})")
    ratios = [{"what": f"kill -9 to the next completed round, median of {len(restarts)}", "ratio": med / steady,
               "against": f"a steady-state round, same run ({args.params:,} parameters, {args.agents} agents)"}]
    raw = {"params": args.params, "agents": args.agents, "steady_round_s": steady,
           "steady_dispatch_to_aggregate_s": round_seconds, "restarts": restarts, "reconnects": stats["reconnects"]}
    print(f"wrote {write_results(args.json, ratios, raw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
