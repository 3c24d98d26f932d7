"""A coordinator's long life in a few minutes: churned agents, a population host, kill -9 restarts.

One command runs the operator's soak of issue 33 in short form and prints its figures against the targets:

    .venv/bin/python benchmarks/soak_bench.py                      # 6 minutes, 16 agents, 32 members, 3 restarts
    .venv/bin/python benchmarks/soak_bench.py --aggregator-ranks 2 --minutes 3
    .venv/bin/python benchmarks/soak_bench.py --quick              # 90 s smoke run

A real `fedpar serve --accept-populations --checkpoint-dir ...` runs digits rounds (first 8 of the live agents,
deadline 4 s) for `--minutes`; `--agents` `fedpar client` processes dial it, one of which is killed with
kill -9 and replaced every `--churn-every` rounds (alternately under the same id and a new one); one
`fedpar simulate-workers` process hosts `--members` members. The coordinator itself is killed with kill -9
`--restarts` times and restarted with the same command. Sampled once a second from /proc: the proportional set
size (PSS) of the coordinator's process tree (its aggregator ranks included), its open file descriptors and
threads. Printed:
- PSS slope in MiB per 100 rounds, fitted per coordinator lifetime after `--warmup` rounds (target <= 0.03),
  and the slope of its anonymous part alone (what the process allocated; library pages come and go with the page cache);
- restart to the first completed round, and the same figure over a steady round (target <= 8 s);
- rounds lost or counted twice in metrics.jsonl (target 0), whether the host stayed alive and was sampled
  after each restart, and the range of fds and threads after warm-up (target: flat);
- which of the coordinator's mappings (/proc/PID/smaps: the heap, anonymous memory, each library) changed in PSS
  between warm-up and the end of each lifetime.
To look for a cause: `--agents 0` (the host alone), `--members 0` (no host), `--churn-every 0` (fixed agents),
`--coordinator-env MALLOC_ARENA_MAX=2` (any variable in the coordinator's environment).
`--json FILE` writes the same figures. docs/how-to/long-running-service.md has the figures measured.
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

from fedpar.parallel.init import free_port

ROOT = Path(__file__).resolve().parents[1]
PER_ROUND = 8


class MetricsTail:
    """The rounds of a growing metrics.jsonl, read incrementally (the file is only appended to, or truncated and
    appended to at a restart)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rows = path, 0, []

    def poll(self) -> list[dict]:
        """Rows appended since the last call (re-read from the start when the file was truncated)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # a restart dropped the rows of a round in flight
            self.offset = 0
            self.rows = []
        new = []
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            if line.strip():
                new.append(json.loads(line))
        self.offset += end
        self.rows.extend(new)
        return new


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _sample(pid: int) -> dict | None:
    """PSS (MiB), its anonymous part (no file behind it: what the process allocated), fds and threads of ``pid``'s
    process tree; None when it is gone."""
    pss_kib, anon_kib, fds, threads = 0, 0, 0, 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss_kib += int(line.split()[1])
                elif line.startswith("Pss_Anon:"):
                    anon_kib += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{p}/fd"))
            threads += int(next(line for line in Path(f"/proc/{p}/status").read_text().splitlines()
                                if line.startswith("Threads:")).split()[1])
        except (OSError, StopIteration):
            if p == pid:
                return None
    return {"pss_mib": pss_kib / 1024, "anon_mib": anon_kib / 1024, "fds": fds, "threads": threads}


def _mappings(pid: int) -> dict[str, int]:
    """PSS (KiB) of ``pid`` per kind of mapping: each file by name, the main heap, thread stacks, and the anonymous
    rest (glibc's thread arenas, mmapped blocks, gRPC's and torch's own)."""
    out: dict[str, int] = {}
    name = None
    try:
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            head = line.split(None, 5)
            if "-" in head[0] and not head[0].endswith(":"):
                name = Path(head[5].strip()).name if len(head) > 5 and head[5].startswith("/") else \
                    (head[5].strip() if len(head) > 5 else "[anon]")
            elif head[0] == "Pss:":
                out[name] = out.get(name, 0) + int(head[1])
    except OSError:
        return {}
    return out


def _grown(before: dict[str, int], after: dict[str, int], least_kib: int = 128) -> dict[str, int]:
    """The mappings whose PSS changed by at least ``least_kib`` KiB, and the total, largest change first."""
    change = {n: after.get(n, 0) - before.get(n, 0) for n in set(before) | set(after)}
    out = {n: d for n, d in sorted(change.items(), key=lambda kv: -abs(kv[1])) if abs(d) >= least_kib}
    return {**out, "total": sum(change.values())}


def _slope_per_100(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of (round, MiB) points, in MiB per 100 rounds."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


class Soak:
    """The processes of one soak run and what was sampled of them."""

    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.port = free_port()
        self.server = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.coordinator: subprocess.Popen | None = None
        self.agents: dict[int, subprocess.Popen] = {}
        self.host: subprocess.Popen | None = None
        self.tail = MetricsTail(work / "out" / "metrics.jsonl")
        self.lifetimes: list[dict] = []  # per coordinator process: start, samples, first round

    def _log(self, name: str):
        return open(self.work / f"{name}.log", "a")

    def start_coordinator(self) -> None:
        """Start (or restart, with the same command) the coordinator (``--coordinator-env`` added to its
        environment)."""
        cmd = [sys.executable, "-m", "fedpar", "serve", "--insecure", "--host", "127.0.0.1", "--port", str(self.port),
               "--dataset", "digits", "--deadline", "4", "--clients-per-round", str(PER_ROUND),
               "--min-available", str(PER_ROUND), "--checkpoint-dir", str(self.work / "ckpt"),
               "--out", str(self.work / "out"), "--accept-populations", "--rounds", "100000",
               "--aggregator-ranks", str(self.args.aggregator_ranks)]
        env = {**self.env, **dict(kv.split("=", 1) for kv in self.args.coordinator_env)}
        self.coordinator = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log("serve"),
                                            stderr=subprocess.STDOUT)
        self.lifetimes.append({"started": time.monotonic(), "samples": [], "first_round_at": None,
                               "first_round": None, "mappings_at_warmup": None, "mappings_grown": None})

    def start_agent(self, slot: int, agent_id: str) -> None:
        """Start one `fedpar client` in ``slot`` under ``agent_id``."""
        cmd = [sys.executable, "-m", "fedpar", "client", "--insecure", "--server", self.server, "--agent-id", agent_id,
               "--dataset", "digits", "--num-partitions", str(self.args.agents), "--partition-index", str(slot),
               "--max-backoff", "1"]
        self.agents[slot] = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self._log(f"agent{slot}"),
                                             stderr=subprocess.STDOUT)

    def start_host(self) -> None:
        """Start one `fedpar simulate-workers` hosting the members."""
        cmd = [sys.executable, "-m", "fedpar", "simulate-workers", "--server", self.server,
               "--clients", str(self.args.members), "--seats", "4"]
        self.host = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self._log("host"), stderr=subprocess.STDOUT)

    def observe(self) -> None:
        """Read new rounds and sample the coordinator's tree."""
        life = self.lifetimes[-1]
        for row in self.tail.poll():
            if life["first_round_at"] is None:
                life["first_round_at"], life["first_round"] = time.monotonic(), row["round"]
        sample = _sample(self.coordinator.pid)
        if sample is not None and self.tail.rows:
            life["samples"].append({"round": self.tail.rows[-1]["round"], **sample})
            if life["mappings_at_warmup"] is None and life["first_round"] is not None \
                    and self.tail.rows[-1]["round"] >= life["first_round"] + self.args.warmup:
                life["mappings_at_warmup"] = _mappings(self.coordinator.pid)

    def note_mappings(self) -> None:
        """Which of the coordinator's mappings grew since warm-up (before it is stopped or killed)."""
        life = self.lifetimes[-1]
        if life["mappings_at_warmup"] is not None:
            now = _mappings(self.coordinator.pid)
            if now:
                life["mappings_grown"] = _grown(life["mappings_at_warmup"], now)

    def stop(self) -> int | None:
        """SIGTERM to the coordinator's PID alone (as a supervisor sends it); its exit code, or None if it hung."""
        self.coordinator.send_signal(signal.SIGTERM)
        try:
            return self.coordinator.wait(30)
        except subprocess.TimeoutExpired:
            return None

    def kill_all(self) -> None:
        """Kill whatever is left of every process tree."""
        procs = [self.coordinator, self.host, *self.agents.values()]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                for p in reversed(_tree(proc.pid)):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for proc in procs:
            if proc is not None:
                proc.wait()


def run(args) -> dict:
    """The soak run; its figures."""
    work = Path(tempfile.mkdtemp(prefix="fedpar-soak-"))
    soak = Soak(args, work)
    soak.start_coordinator()
    for slot in range(args.agents):
        soak.start_agent(slot, f"agent-{slot}")
    if args.members:
        soak.start_host()
    duration = args.minutes * 60
    began = time.monotonic()
    restart_at = [began + duration * (k + 1) / (args.restarts + 1) for k in range(args.restarts)]
    churned, new_ids, next_churn, restarts, host_died = 0, 0, args.churn_every, [], None
    try:
        while time.monotonic() - began < duration:
            time.sleep(1.0)
            soak.observe()
            last = soak.tail.rows[-1]["round"] if soak.tail.rows else 0
            if soak.host is not None and soak.host.poll() is not None and host_died is None:
                host_died = {"exit": soak.host.returncode, "after_round": last}
            if args.churn_every and args.agents and last >= next_churn:  # kill -9 one agent, replace it (same id,
                # then a new one, alternately)
                slot = churned % args.agents
                soak.agents[slot].kill()
                soak.agents[slot].wait()
                new_ids += churned % 2
                soak.start_agent(slot, f"agent-{slot}" if churned % 2 == 0 else f"agent-{slot}-n{new_ids}")
                churned += 1
                next_churn = last + args.churn_every
            if restart_at and time.monotonic() >= restart_at[0]:
                restart_at.pop(0)
                soak.note_mappings()
                for p in reversed(_tree(soak.coordinator.pid)):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                soak.coordinator.wait()
                restarts.append({"after_round": last})
                soak.start_coordinator()
        soak.observe()
        soak.note_mappings()
        exit_code = soak.stop()
        soak.observe()
    finally:
        soak.kill_all()
    soak.tail.poll()
    rows = soak.tail.rows
    rounds = [r["round"] for r in rows]
    expected = list(range(1, max(rounds) + 1)) if rounds else []
    lost = sorted(set(expected) - set(rounds))
    twice = sorted(r for r in set(rounds) if rounds.count(r) > 1)
    steady = statistics.median(r["round_seconds"] for r in rows) if rows else None
    lifetimes = []
    for k, life in enumerate(soak.lifetimes):
        start_round = life["first_round"] or 0
        warm = [s for s in life["samples"] if s["round"] >= start_round + args.warmup]
        lifetimes.append({
            "restart": k > 0,
            "to_first_round_s": (life["first_round_at"] - life["started"]) if life["first_round_at"] else None,
            "rounds": (life["samples"][-1]["round"] - start_round) if life["samples"] else 0,
            "pss_slope_mib_per_100_rounds": _slope_per_100([(s["round"], s["pss_mib"]) for s in warm]),
            "anon_slope_mib_per_100_rounds": _slope_per_100([(s["round"], s["anon_mib"]) for s in warm]),
            "pss_mib": [round(warm[0]["pss_mib"], 1), round(warm[-1]["pss_mib"], 1)] if warm else None,
            "fds": [min(s["fds"] for s in warm), max(s["fds"] for s in warm)] if warm else None,
            "threads": [min(s["threads"] for s in warm), max(s["threads"] for s in warm)] if warm else None,
            "mappings_grown_kib": life["mappings_grown"],
        })
    restart_s = [life["to_first_round_s"] for life in lifetimes[1:] if life["to_first_round_s"] is not None]
    slopes = [life["pss_slope_mib_per_100_rounds"] for life in lifetimes
              if life["pss_slope_mib_per_100_rounds"] is not None]
    return {
        "work": str(work), "minutes": args.minutes, "aggregator_ranks": args.aggregator_ranks,
        "agents": args.agents, "members": args.members, "churned_agents": churned, "restarts": len(restarts),
        "rounds": len(set(rounds)), "rounds_lost": lost, "rounds_twice": twice,
        "steady_round_s": steady, "restart_to_first_round_s": restart_s,
        "pss_slope_mib_per_100_rounds": slopes, "lifetimes": lifetimes,
        "host_died": host_died, "sigterm_exit": exit_code,
        "summary_written": (work / "out" / "summary.json").exists(),
    }


def report(fig: dict) -> None:
    """Print the figures against the targets."""
    print(f"\nsoak: {fig['minutes']} min, {fig['aggregator_ranks']} aggregator rank(s), {fig['agents']} agents "
          f"({fig['churned_agents']} churned), {fig['members']} hosted members, {fig['restarts']} kill -9 restarts; "
          f"{fig['rounds']} rounds (work dir {fig['work']})\n")
    print(f"{'lifetime':<10}{'rounds':>8}{'to 1st round s':>16}{'PSS MiB':>16}{'MiB/100 rounds':>16}"
          f"{'anon MiB/100':>14}{'fds':>10}{'threads':>10}")
    for k, life in enumerate(fig["lifetimes"]):
        pss = "-" if not life["pss_mib"] else f"{life['pss_mib'][0]:.0f}->{life['pss_mib'][1]:.0f}"
        slope = life["pss_slope_mib_per_100_rounds"]
        first = life["to_first_round_s"]
        span = lambda v: "-" if not v else f"{v[0]}-{v[1]}"  # noqa: E731
        anon = life["anon_slope_mib_per_100_rounds"]
        print(f"{k:<10}{life['rounds']:>8}{'-' if first is None else f'{first:.1f}':>16}{pss:>16}"
              f"{'-' if slope is None else f'{slope:+.3f}':>16}{'-' if anon is None else f'{anon:+.3f}':>14}"
              f"{span(life['fds']):>10}{span(life['threads']):>10}")
    for k, life in enumerate(fig["lifetimes"]):
        if life["mappings_grown_kib"]:
            print(f"lifetime {k}: PSS change after warm-up by mapping (KiB): "
                  + ", ".join(f"{n} {d:+d}" for n, d in life["mappings_grown_kib"].items()))
    slopes, restarts = fig["pss_slope_mib_per_100_rounds"], fig["restart_to_first_round_s"]
    print()
    if slopes:
        print(f"PSS slope after warm-up: median {statistics.median(slopes):+.3f}, max {max(slopes):+.3f} "
              f"MiB per 100 rounds (target <= 0.03)")
    if restarts and fig["steady_round_s"]:
        med = statistics.median(restarts)
        print(f"restart to first completed round: median {med:.1f} s, max {max(restarts):.1f} s "
              f"= {med / fig['steady_round_s']:.0f}x a steady round of {fig['steady_round_s']:.3f} s (target <= 8 s)")
    print(f"rounds lost: {len(fig['rounds_lost'])}, counted twice: {len(fig['rounds_twice'])} (target 0); "
          f"population host {'alive throughout' if not fig['host_died'] else 'died: ' + json.dumps(fig['host_died'])}; "
          f"SIGTERM to the coordinator's PID: exit {fig['sigterm_exit']}, summary.json "
          f"{'written' if fig['summary_written'] else 'missing'}")


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print (and optionally save) its figures."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=6.0, help="how long the federation runs")
    p.add_argument("--agents", type=int, default=16, help="`fedpar client` processes")
    p.add_argument("--members", type=int, default=32, help="members of the `fedpar simulate-workers` host (0: no host)")
    p.add_argument("--churn-every", type=int, default=25, help="rounds between two agent kill -9s (0: no churn)")
    p.add_argument("--restarts", type=int, default=3, help="kill -9 restarts of the coordinator")
    p.add_argument("--warmup", type=int, default=200, help="rounds of each lifetime left out of the PSS slope")
    p.add_argument("--aggregator-ranks", type=int, default=1)
    p.add_argument("--coordinator-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in the coordinator's environment (e.g. MALLOC_ARENA_MAX=2), to compare")
    p.add_argument("--quick", action="store_true", help="smoke run: 1.5 minutes, 8 agents, 1 restart")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.agents, args.members, args.restarts, args.warmup = 1.5, 8, 16, 1, 50
    fig = run(args)
    report(fig)
    if args.json:
        args.json.write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
