"""Restart of a `fedpar serve --aggregator-ranks R` coordinator after `kill -9`, to its first completed round.

    .venv/bin/python benchmarks/restart_serve.py                 # 2 ranks, 10 agents, 3 restarts of each kind
    .venv/bin/python benchmarks/restart_serve.py --ranks 1 --restarts 2

The coordinator is soak.py's (digits, the MLP, 8 agents a round, deadline 0.5 s, a checkpoint every round); the
agents are real agents in threads of one process (soak.agent_group) that re-join by themselves, waiting at
most `--agent-max-backoff` between tries (an agent's default `--max-backoff`). The coordinator is
killed with its ranks and started again with the same command, alternately with its ranks forked from the launcher
(what serve does on a machine without a GPU) and spawned as fresh interpreters (what it does with a GPU, and did
everywhere before: each rank imports torch again), so both are measured under the same load. Each restart is timed
from the new process's start to: its log line saying it resumed, and the first round after the checkpointed one
in metrics.jsonl. The load average is printed beside the figures; ratios: spawned over forked, median of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import RESULTS, write_results  # benchmarks/, this script's folder
from soak import MetricsTail, _kill_tree

from fedpar.cli.argtypes import FedparParser
from fedpar.client.backoff import MAX_BACKOFF_SECONDS
from fedpar.ports import ReservedPort

ROOT = Path(__file__).resolve().parents[1]
# The launcher of the spawned variant: serve as the command line runs it, told that forking is not safe here.
SPAWNED = ("import sys; import fedpar.parallel.init as launch; launch.fork_safe = lambda: False; "
           "from fedpar.cli.main import main; sys.exit(main())")


class Coordinator:
    """One restartable serve command and the metrics it writes."""

    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.reserved = ReservedPort()  # held while this process lives: each start of the coordinator binds it
        self.port = self.reserved.port
        self.tail = MetricsTail(work / "out" / "metrics.jsonl")
        self.log = work / "serve.log"
        self.proc: subprocess.Popen | None = None
        self.env = {**os.environ, "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])}

    def start(self, spawned: bool) -> float:
        """Start the coordinator (ranks spawned or forked); the monotonic time it started."""
        serve = ["serve", "--insecure", "--host", "127.0.0.1", "--port", str(self.port), "--dataset", "digits",
                 "--model", "mlp", "--deadline", "0.5", "--clients-per-round", "8", "--min-available", "8",
                 "--checkpoint-dir", str(self.work / "ckpt"), "--out", str(self.work / "out"), "--rounds", "1000000",
                 "--aggregator-ranks", str(self.args.ranks)]
        head = [sys.executable, "-c", SPAWNED] if spawned else [sys.executable, "-m", "fedpar"]
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        started = time.monotonic()
        self.proc = subprocess.Popen(head + serve, cwd=ROOT, env=self.env, stdout=open(self.log, "a"),
                                     stderr=subprocess.STDOUT)
        return started

    def last_round(self) -> int:
        """The last round in metrics.jsonl (0: none yet)."""
        self.tail.poll()
        return self.tail.rows[-1]["round"] if self.tail.rows else 0

    def resumed(self) -> bool:
        """Whether this lifetime's log says it resumed from its checkpoint."""
        with self.log.open("rb") as fh:
            fh.seek(self.log_offset)
            return b"resumed from checkpoint" in fh.read()

    def wait_round(self, round_id: int, timeout: float = 300.0, on_poll=None) -> float:
        """Wait until round ``round_id`` is in metrics.jsonl; the monotonic time it was seen."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if on_poll is not None:
                on_poll()
            if self.last_round() >= round_id:
                return time.monotonic()
            if self.proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited ({self.proc.returncode}); see {self.log}")
            time.sleep(0.02)
        raise TimeoutError(f"round {round_id} did not complete; see {self.log}")

    def kill(self) -> None:
        """kill -9 the coordinator and its ranks."""
        _kill_tree(self.proc.pid)
        self.proc.wait()


def restart(coordinator: Coordinator, spawned: bool) -> dict:
    """Kill the coordinator, start it again; the seconds to its resumed line and to its first completed round."""
    coordinator.kill()
    time.sleep(0.2)  # the rows the killed process wrote are in the file
    last = coordinator.last_round()
    started = coordinator.start(spawned)
    seen: dict[str, float] = {}

    def note_resumed():
        if "resumed" not in seen and coordinator.resumed():
            seen["resumed"] = time.monotonic()

    done = coordinator.wait_round(last + 1, on_poll=note_resumed)
    note_resumed()
    return {"ranks": "spawned" if spawned else "forked", "after_round": last,
            "resumed_s": round(seen["resumed"] - started, 3) if "resumed" in seen else None,
            "first_round_s": round(done - started, 3), "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="--aggregator-ranks of the coordinator (2 or more: with one "
                   "the coordinator starts no rank processes, and both kinds are the same)")
    p.add_argument("--agents", type=int, default=10, help="agents (threads of one process)")
    p.add_argument("--restarts", type=int, default=3, help="restarts of each kind (forked, spawned), alternating")
    p.add_argument("--gap", type=int, default=5, help="rounds between restarts")
    p.add_argument("--agent-max-backoff", type=float, default=MAX_BACKOFF_SECONDS,
                   help="the agents' longest wait between tries while the coordinator is down (default: an agent's "
                   "default --max-backoff)")
    p.add_argument("--json", type=Path, default=RESULTS / "restart_serve.json", help="where the figures go")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fedpar-restart-serve-"))
    coordinator = Coordinator(args, work)
    coordinator.start(spawned=False)
    server = f"127.0.0.1:{coordinator.port}"
    call = (f"from soak import agent_group; agent_group({server!r}, list(range({args.agents})), {args.agents}, 0, 0, "
            f"{args.agent_max_backoff!r})")
    agents = subprocess.Popen([sys.executable, "-c", call], cwd=ROOT, env=coordinator.env,
                              stdout=subprocess.DEVNULL, stderr=open(work / "agents.log", "a"))
    load_before = os.getloadavg()
    runs = []
    try:
        coordinator.wait_round(args.gap)
        for k in range(2 * args.restarts):
            runs.append(restart(coordinator, spawned=k % 2 == 1))
            coordinator.wait_round(coordinator.last_round() + args.gap)
    finally:
        for proc in (coordinator.proc, agents):
            if proc is not None and proc.poll() is None:
                _kill_tree(proc.pid)
                proc.wait()
    load_after = os.getloadavg()
    print(f"\n`fedpar serve --aggregator-ranks {args.ranks}` restarted after kill -9 under {args.agents} agents "
          f"(load average {load_before[0]:.1f} before, {load_after[0]:.1f} after)\n")
    print(f"{'ranks':<10}{'after round':>12}{'resumed (s)':>13}{'first round (s)':>17}{'load':>7}")
    for r in runs:
        resumed = f"{r['resumed_s']:.2f}" if r["resumed_s"] is not None else "-"
        print(f"{r['ranks']:<10}{r['after_round']:>12}{resumed:>13}{r['first_round_s']:>17.2f}{r['load']:>7.1f}")
    median = {kind: statistics.median(r["first_round_s"] for r in runs if r["ranks"] == kind)
              for kind in ("forked", "spawned")}
    print(f"\nmedian restart to first completed round: forked {median['forked']:.2f} s, spawned "
          f"{median['spawned']:.2f} s ({median['spawned'] / median['forked']:.2f}x)")
    ratios = [{"what": "restart to first completed round, ranks spawned (median)",
               "ratio": median["spawned"] / median["forked"],
               "against": "ranks forked from the launcher (median), alternating in the same run"}]
    raw = {"ranks": args.ranks, "agents": args.agents, "load_average": [load_before[0], load_after[0]],
           "median_first_round_s": median, "restarts": runs, "work": str(work)}
    print(f"wrote {write_results(args.json, ratios, raw, argv=[sys.argv[0], *(sys.argv[1:] if argv is None else argv)])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
