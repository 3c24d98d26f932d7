"""A coordinator's long life in an hour: churned agents (some hostile), kill -9 of agents, ranks and the coordinator.

One command runs "a week in an hour" (issue 30) and prints its figures against the targets:

    .venv/bin/python benchmarks/soak.py                       # 1,000 rounds: 2 ranks, 50 agents (3 hostile), kills
    .venv/bin/python benchmarks/soak.py --quick               # a smoke run: 150 rounds
    .venv/bin/python benchmarks/soak.py --aggregator-ranks 1 --agents 16 --agents-per-process 1 --members 32 \
        --hostile 0 --deadline 4 --rank-kills 0 --restarts 1 --rounds 0 --minutes 20     # issue 33's operator soak

A real `fedpar serve --checkpoint-dir ... --aggregator-ranks R` runs digits rounds (the MLP; the first
`--per-round` of the live agents, deadline `--deadline`) until `--rounds` rounds are done (or `--minutes` passed).
`--agents` real agents (client/agent.py) dial it: `--agents-per-process` 1 runs each as a `fedpar client`
process, more runs them in threads of shared processes (a 2-core machine cannot start 50 torch processes); in
each such process agents leave and join again at random (half of the time under a new id). Every `--churn-every`
rounds one agent process is killed with kill -9 and started again. `--hostile` of the agents are the abuse
agents of tests/support/abuse.py: trickling uploads (each holds a staging slot until its pace is refused) and
inflated updates (the most examples they may claim, weights of 1000; the coordinator runs with
`--max-agent-share 0.25`). `--members` members of one `fedpar simulate-workers` host join too (0: none).
The coordinator is killed with kill -9 `--restarts` times, and `--rank-kills` times one non-zero aggregator rank
is: at random rounds. A killed coordinator is restarted with the same command (it resumes from its checkpoint);
after a rank's kill the coordinator either goes on with the other ranks or ends, and is then restarted the same
way: both are counted.

Sampled once a second from /proc, per process of the coordinator's tree (the launcher and each rank): the
proportional set size (PSS), its anonymous part (what the process allocated: library pages' PSS also moves when
other processes that map them start or end), open file descriptors and threads. Printed:
- rounds lost or counted twice in metrics.jsonl (target 0), rounds failed, p50/p99 round time;
- per coordinator lifetime and process: PSS after warm-up, the PSS and anonymous slopes in MiB per 100 rounds
  (target <= 0.03), the same through each 50 rounds' lowest sample (the floor: what the process keeps, without the
  buffers of a round in flight that a sample may catch), fds and threads;
- per 100 rounds: each process's peak and final PSS, the tree's fds and threads;
- restart to the first completed round, and which of the coordinator's mappings changed after warm-up.
`--coordinator-env KEY=VALUE` sets a variable in the coordinator's environment (e.g. MALLOC_ARENA_MAX=2, or
FEDPAR_HEAP_TRACE=FILE:EVERY, protocol/heap.py: the allocation sites that grew). `--json FILE` writes the
figures (default benchmarks/results/soak.json, in benchmarks/results.py's envelope).
docs/how-to/long-running-service.md has the figures measured.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.ports import ReservedPort

ROOT = Path(__file__).resolve().parents[1]
MIN_SLOPE_ROUNDS = 150  # a lifetime with fewer rounds after its warm-up gets no slope
FLOOR_WINDOW = 50  # rounds whose lowest sample is one point of the floor slope
sys.path.insert(0, str(ROOT / "tests"))  # tests/support: the abuse agents; the hostile processes inherit it
from results import RESULTS, write_results  # noqa: E402  (benchmarks/, this script's folder)


class MetricsTail:
    """The rounds of a growing metrics.jsonl, read incrementally (the file is only appended to, or cut after the
    checkpointed round and appended to at a restart)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rows = path, 0, []

    def poll(self) -> list[dict]:
        """Rows appended since the last call (re-read from the start when the file was cut)."""
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


def _kill_tree(pid: int) -> None:
    """kill -9 ``pid`` and its descendants."""
    for p in reversed(_tree(pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _ranks_logged(log: Path, offset: int) -> dict[int, str]:
    """pid -> ``rankN`` of the non-zero aggregator ranks the coordinator's log names after byte ``offset`` (a
    spawned rank's RANK is set after it started, so /proc does not show it)."""
    try:
        with log.open("rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return {}
    found = re.findall(r"aggregator rank (\d+) \(pid (\d+)\) serving", text)
    return {int(pid): f"rank{rank}" for rank, pid in found}


def _roles(root: int, ranks: dict[int, str]) -> dict[int, str]:
    """pid -> role in the coordinator's tree: ``launcher`` (the serve process), ``rankN`` for the logged ranks, and
    ``rank0`` for the launcher's other rank process when there are ranks (forked, or spawned: multiprocessing's
    ``spawn_main``; not its resource tracker), with one rank the launcher is the coordinator."""
    out = {root: "launcher"}
    for pid in _tree(root)[1:]:
        if pid in ranks:
            out[pid] = ranks[pid]
        elif ranks:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == root and b"resource_tracker" not in cmd:
                out[pid] = "rank0"
    return out


def _sample_one(pid: int) -> dict | None:
    """PSS and its anonymous part (MiB), fds and threads of process ``pid``; None when it is gone."""
    pss_kib = anon_kib = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss_kib = int(line.split()[1])
            elif line.startswith("Pss_Anon:"):
                anon_kib = int(line.split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                           if line.startswith("Threads:")).split()[1])
    except (OSError, StopIteration):
        return None
    return {"pss_mib": pss_kib / 1024, "anon_mib": anon_kib / 1024, "fds": fds, "threads": threads}


def _sample(roles: dict[int, str]) -> dict[str, dict]:
    """:func:`_sample_one` of each process of the coordinator's tree, by role (launcher, rank0, rank1, ...)."""
    out = {}
    for pid, role in roles.items():
        sample = _sample_one(pid)
        if sample is not None:
            out[role] = sample
    return out


PYMALLOC_ARENA = 1 << 20  # Python's object allocator maps its arenas in blocks of this size (CPython 3.10+)


def _mappings(pid: int) -> dict[str, int]:
    """PSS (KiB) of ``pid`` per kind of mapping: each file by name, the main heap, Python's object arenas, and the
    anonymous rest (glibc's thread heaps, mmapped blocks, thread stacks, gRPC's and torch's own)."""
    out: dict[str, int] = {}
    name = None
    try:
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            head = line.split(None, 5)
            if "-" in head[0] and not head[0].endswith(":"):
                start, end = (int(a, 16) for a in head[0].split("-"))
                name = Path(head[5].strip()).name if len(head) > 5 and head[5].startswith("/") else \
                    (head[5].strip() if len(head) > 5 else
                     "[python arenas]" if end - start == PYMALLOC_ARENA else "[anon]")
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


def _slope_error_per_100(points: list[tuple[int, float]], window: int = FLOOR_WINDOW) -> float | None:
    """Standard error of the slope of (round, MiB) points, in MiB per 100 rounds, from the means of each ``window``
    rounds (batch means: consecutive samples are not independent, a round's buffers in flight last several): a
    slope within about two of these of the target cannot be told from it."""
    windows: dict[int, list[tuple[int, float]]] = {}
    for r, mib in points:
        windows.setdefault(r // window, []).append((r, mib))
    means = [(statistics.fmean(r for r, _ in w), statistics.fmean(m for _, m in w)) for w in windows.values()]
    slope = _slope_per_100(means)
    if slope is None or len(means) < 4:
        return None
    xs, ys = [p[0] for p in means], [p[1] for p in means]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    residuals = sum((y - my - slope / 100 * (x - mx)) ** 2 for x, y in means)
    return 100 * math.sqrt(residuals / (len(means) - 2) / sxx)


def _floor_slope_per_100(points: list[tuple[int, float]], window: int = FLOOR_WINDOW) -> float | None:
    """Slope of the floor of (round, MiB) points, in MiB per 100 rounds: the least-squares slope through each
    ``window`` rounds' lowest sample. A sample taken while a round holds its uploads and model copies lies up to
    several MiB above what the process keeps; the floor is what it keeps, so a leak moves it and a busy moment not."""
    floors: dict[int, tuple[int, float]] = {}
    for r, mib in points:
        key = r // window
        if key not in floors or mib < floors[key][1]:
            floors[key] = (key * window + window // 2, mib)
    return _slope_per_100(sorted(floors.values()))


def _percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# ----------------------------------------------------------------------------- agents sharing a process
def agent_group(server: str, slots: list[int], partitions: int, seed: int, leave_every: float,
                max_backoff: float = 1.0) -> None:
    """Run real agents (client/agent.py, digits MLP) for ``slots`` in threads of this process, until killed. Each
    leaves after a random time (mean ``leave_every`` seconds; 0: never) and joins again a few seconds later, half
    of the time under a new id. Each waits at most ``max_backoff`` seconds between tries at a coordinator that is
    down."""
    import threading

    import torch

    from fedpar.client.agent import Agent, AgentConfig
    from fedpar.client.trainer import LocalTrainer
    from fedpar.datasets import load_dataset
    from fedpar.datasets.clientdata import local_split, partition_indices
    from fedpar.models.for_data import build_model_for_data

    torch.set_num_threads(1)
    rng = random.Random(seed)
    splits = load_dataset("digits")
    parts = partition_indices(splits, "iid", partitions, 0)
    pid = os.getpid()

    def start(slot: int, agent_id: str) -> Agent:
        train, val = local_split(splits.train, parts[slot], 0.1, 0)
        model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
        agent = Agent(AgentConfig(insecure=True, server=server, agent_id=agent_id, poll_seconds=2.0,
                                  initial_backoff=0.1, max_backoff=max_backoff, give_up_after=3600.0),
                      LocalTrainer(model, train, val, seed=slot))
        threading.Thread(target=quietly, args=(agent,), daemon=True).start()
        return agent

    def quietly(agent: Agent) -> None:
        try:
            agent.run()
        except Exception:  # asked to leave while the coordinator was down (restarting): it left
            pass

    running = {slot: start(slot, f"agent-{slot}") for slot in slots}
    leaves = {slot: time.monotonic() + rng.expovariate(1 / leave_every) for slot in slots} if leave_every else {}
    rejoins: dict[int, float] = {}
    renamed = 0
    while True:
        time.sleep(0.5)
        now = time.monotonic()
        for slot, at in list(leaves.items()):
            if now >= at:
                running.pop(slot).stop()
                del leaves[slot]
                rejoins[slot] = now + rng.uniform(1, 5)
        for slot, at in list(rejoins.items()):
            if now >= at:
                renamed += 1
                running[slot] = start(slot, f"agent-{slot}" if rng.random() < 0.5 else f"agent-{slot}-{pid}-{renamed}")
                del rejoins[slot]
                leaves[slot] = now + rng.expovariate(1 / leave_every)


class Soak:
    """The processes of one soak run and what was sampled of them."""

    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.reserved = ReservedPort()  # held while this process lives: each start of the coordinator binds it
        self.port = self.reserved.port
        self.server = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
        self.coordinator: subprocess.Popen | None = None
        self.groups: dict[int, subprocess.Popen] = {}  # agent processes by index
        self.hostile: list = []  # the abuse agents' processes
        self.host: subprocess.Popen | None = None
        self.tail = MetricsTail(work / "out" / "metrics.jsonl")
        self.lifetimes: list[dict] = []  # per coordinator process: start, samples, first round, how it ended
        self.timeline: list[dict] = []  # every sample: round, per role PSS, the tree's fds and threads
        self.rng = random.Random(args.seed)
        self.ctx = mp.get_context("spawn")

    def _log(self, name: str):
        return open(self.work / f"{name}.log", "a")

    def coordinator_command(self) -> list[str]:
        """The serve command (the same at every restart)."""
        a = self.args
        return [sys.executable, "-m", "fedpar", "serve", "--insecure", "--host", "127.0.0.1", "--port", str(self.port),
                "--dataset", "digits", "--model", "mlp", "--deadline", str(a.deadline),
                "--clients-per-round", str(a.per_round), "--min-available", str(a.per_round),
                "--checkpoint-dir", str(self.work / "ckpt"), "--out", str(self.work / "out"),
                "--accept-populations", "--rounds", "1000000", "--aggregator-ranks", str(a.aggregator_ranks),
                "--max-agent-share", "0.25"]

    def start_coordinator(self) -> None:
        """Start (or restart, with the same command) the coordinator (``--coordinator-env`` added to its
        environment)."""
        env = {**self.env, **dict(kv.split("=", 1) for kv in self.args.coordinator_env)}
        self.tail.poll()  # rows the last process wrote since the last look are not this lifetime's first round
        log = self.work / "serve.log"
        self.log_offset = log.stat().st_size if log.exists() else 0  # this lifetime's lines of serve.log start here
        self.coordinator = subprocess.Popen(self.coordinator_command(), cwd=ROOT, env=env, stdout=self._log("serve"),
                                            stderr=subprocess.STDOUT)
        self.lifetimes.append({"started": time.monotonic(), "ready_at": None, "samples": [], "first_round_at": None,
                               "rounds_before": max((r["round"] for r in self.tail.rows), default=0),
                               "first_round": None, "mappings_at_warmup": None, "mappings_grown": None,
                               "ended_by": None, "hostile": False})

    def start_group(self, index: int) -> None:
        """Start agent process ``index``: one `fedpar client`, or a process of agents in threads."""
        a = self.args
        slots = list(range(index * a.agents_per_process, min(a.agents, (index + 1) * a.agents_per_process)))
        if a.agents_per_process == 1:
            cmd = [sys.executable, "-m", "fedpar", "client", "--insecure", "--server", self.server, "--agent-id",
                   f"agent-{slots[0]}-{self.rng.randrange(10**6)}" if self.rng.random() < 0.5 else f"agent-{slots[0]}",
                   "--dataset", "digits", "--num-partitions", str(a.agents), "--partition-index", str(slots[0]),
                   "--max-backoff", "1"]
        else:
            call = (f"from soak import agent_group; agent_group({self.server!r}, {slots!r}, {a.agents}, "
                    f"{self.rng.randrange(10**6)}, {a.leave_every})")
            cmd = [sys.executable, "-c", call]
        self.groups[index] = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self._log(f"agents{index}"),
                                              stderr=subprocess.STDOUT)

    def start_hostile(self) -> None:
        """(Re)start the abuse agents: they join once, so they start again once each coordinator lifetime serves."""
        from support.abuse import inflated_updates, trickling_uploads

        from fedpar.datasets import load_dataset
        from fedpar.models import weight_specs
        from fedpar.models.for_data import build_model_for_data

        self.stop_hostile()
        n = math.ceil(self.args.hostile * self.args.agents)
        if not n:
            return
        splits = load_dataset("digits")
        specs = weight_specs(build_model_for_data("mlp", splits.input_shape, splits.num_classes))
        ids = [f"hostile-{k}" for k in range(n)]
        trickle, inflate = ids[: (n + 1) // 2], ids[(n + 1) // 2:]
        for target, extra in ((trickling_uploads, (trickle, specs)), (inflated_updates, (inflate, specs, 40))):
            if not extra[0]:
                continue
            start, stop, out = self.ctx.Event(), self.ctx.Event(), self.ctx.Queue()
            start.set()
            proc = self.ctx.Process(target=target, args=(self.server, *extra, start, stop, out), daemon=True)
            proc.start()
            self.hostile.append((proc, start, stop, out))  # the events must outlive the child's start

    def stop_hostile(self) -> None:
        """kill -9 the abuse agents."""
        for proc, *_ in self.hostile:
            proc.kill()
            proc.join()
        self.hostile = []

    def start_host(self) -> None:
        """Start one `fedpar simulate-workers` hosting the members."""
        cmd = [sys.executable, "-m", "fedpar", "simulate-workers", "--server", self.server, "--insecure",
               "--clients", str(self.args.members), "--seats", "4"]
        self.host = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self._log("host"), stderr=subprocess.STDOUT)

    def _log_since(self) -> bytes:
        """This lifetime's lines of serve.log."""
        with (self.work / "serve.log").open("rb") as fh:
            fh.seek(self.log_offset)
            return fh.read()

    def roles(self) -> dict[int, str]:
        """pid -> role of the coordinator's processes now (see :func:`_roles`)."""
        ranks = _ranks_logged(self.work / "serve.log", self.log_offset) if self.args.aggregator_ranks > 1 else {}
        return _roles(self.coordinator.pid, ranks)

    def role_pid(self, role: str) -> int | None:
        """The pid of ``role`` in the coordinator's tree (None: not running)."""
        return next((pid for pid, r in self.roles().items() if r == role), None)

    def observe(self) -> None:
        """Read new rounds and sample the coordinator's tree."""
        life = self.lifetimes[-1]
        for row in self.tail.poll():  # a cut file is read again: only a round past the last one seen is new
            if life["first_round_at"] is None and row["round"] > life["rounds_before"]:
                life["first_round_at"], life["first_round"] = time.monotonic(), row["round"]
        if life["ready_at"] is None and b"resumed from checkpoint" in self._log_since():
            life["ready_at"] = time.monotonic()
        if self.coordinator.poll() is not None or not self.tail.rows:
            return
        sample = _sample(self.roles())
        if not sample:
            return
        last = self.tail.rows[-1]["round"]
        life["samples"].append({"round": last, "procs": sample})
        self.timeline.append({"round": last, "pss_mib": {r: round(s["pss_mib"], 2) for r, s in sample.items()},
                              "fds": sum(s["fds"] for s in sample.values()),
                              "threads": sum(s["threads"] for s in sample.values())})
        if life["mappings_at_warmup"] is None and life["first_round"] is not None \
                and last >= life["first_round"] + self.args.warmup:
            life["mappings_at_warmup"] = self._coordinator_mappings()

    def _coordinator_mappings(self) -> dict[str, int]:
        pid = self.role_pid("rank0") if self.args.aggregator_ranks > 1 else self.coordinator.pid
        return _mappings(pid) if pid else {}

    def note_mappings(self) -> None:
        """Which of the coordinator's (rank 0's) mappings changed since warm-up (before it is stopped or killed)."""
        life = self.lifetimes[-1]
        if life["mappings_at_warmup"] is not None:
            now = self._coordinator_mappings()
            if now:
                life["mappings_grown"] = _grown(life["mappings_at_warmup"], now)

    def restart_coordinator(self, why: str) -> None:
        """kill -9 what is left of the coordinator's tree and start it again with the same command."""
        self.lifetimes[-1]["ended_by"] = why
        _kill_tree(self.coordinator.pid)
        self.coordinator.wait()
        self.start_coordinator()

    def stop(self) -> int | None:
        """SIGTERM to the coordinator's PID alone (as a supervisor sends it); its exit code, or None if it hung."""
        self.coordinator.send_signal(signal.SIGTERM)
        try:
            return self.coordinator.wait(60)
        except subprocess.TimeoutExpired:
            return None

    def kill_all(self) -> None:
        """Kill whatever is left of every process tree."""
        self.stop_hostile()
        procs = [self.coordinator, self.host, *self.groups.values()]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                _kill_tree(proc.pid)
        for proc in procs:
            if proc is not None:
                proc.wait()


def _kill_rounds(rng: random.Random, count: int, rounds: int, warmup: int) -> list[int]:
    """``count`` random rounds in (warmup, rounds), sorted."""
    if count <= 0 or rounds <= warmup:
        return []
    return sorted(rng.sample(range(warmup + 1, rounds), min(count, rounds - warmup - 1)))


def run(args) -> dict:
    """The soak run; its figures."""
    work = Path(tempfile.mkdtemp(prefix="fedpar-soak-"))
    soak = Soak(args, work)
    soak.start_coordinator()
    processes = math.ceil(args.agents / args.agents_per_process) if args.agents else 0
    for index in range(processes):
        soak.start_group(index)
    if args.members:
        soak.start_host()
    span = args.rounds or 10**9
    spacing = max(args.warmup, 1)
    coordinator_kills = _kill_rounds(soak.rng, args.restarts, span, spacing) if args.rounds else []
    rank_kills = _kill_rounds(soak.rng, args.rank_kills, span, spacing) if args.rounds and args.aggregator_ranks > 1 \
        else []
    began = time.monotonic()
    restart_at = [began + args.minutes * 60 * (k + 1) / (args.restarts + 1) for k in range(args.restarts)] \
        if not args.rounds else []
    group_kills, next_kill, host_died, events, pending_rank = 0, args.churn_every, None, [], None
    try:
        while time.monotonic() - began < args.minutes * 60:
            time.sleep(1.0)
            soak.observe()
            last = soak.tail.rows[-1]["round"] if soak.tail.rows else 0
            if args.rounds and last >= args.rounds:
                break
            if soak.lifetimes[-1]["first_round"] is not None and not soak.lifetimes[-1]["hostile"]:
                soak.start_hostile()  # they join once: when this coordinator serves
                soak.lifetimes[-1]["hostile"] = True
            if soak.host is not None and soak.host.poll() is not None and host_died is None:
                host_died = {"exit": soak.host.returncode, "after_round": last}
            if args.churn_every and processes and last >= next_kill:  # kill -9 one agent process, start it again
                index = soak.rng.randrange(processes)
                _kill_tree(soak.groups[index].pid)
                soak.groups[index].wait()
                soak.start_group(index)
                group_kills += 1
                next_kill = last + args.churn_every
            if pending_rank is not None:  # a rank was killed: does the coordinator go on without it?
                code = soak.coordinator.poll()
                if code is not None or time.monotonic() >= pending_rank["check_at"]:
                    pending_rank.update(survived=code is None, code=code)
                    events.append({k: v for k, v in pending_rank.items() if k != "check_at"})
                    pending_rank = None
                    if code is not None:  # it ended with its rank: restarted like a coordinator crash
                        soak.restart_coordinator("rank kill")
                continue
            if soak.coordinator.poll() is not None:  # it ended by itself: restart it the same way, and say so
                events.append({"kind": "coordinator ended", "after_round": last, "code": soak.coordinator.returncode})
                soak.restart_coordinator("ended")
                continue
            if rank_kills and last >= rank_kills[0] and soak.lifetimes[-1]["first_round"] is not None:
                rank_kills.pop(0)
                rank = soak.rng.randrange(1, args.aggregator_ranks)
                pid = soak.role_pid(f"rank{rank}")
                if pid is not None:
                    soak.note_mappings()
                    os.kill(pid, signal.SIGKILL)
                    pending_rank = {"kind": "rank kill", "rank": rank, "after_round": last,
                                    "check_at": time.monotonic() + 15}
            if (coordinator_kills and last >= coordinator_kills[0] and soak.lifetimes[-1]["first_round"] is not None) \
                    or (restart_at and time.monotonic() >= restart_at[0]):
                (coordinator_kills or restart_at).pop(0)
                soak.note_mappings()
                events.append({"kind": "coordinator kill", "after_round": last})
                soak.restart_coordinator("kill -9")
        if pending_rank is not None:  # the run ended before the check: the coordinator is still here or not
            code = soak.coordinator.poll()
            pending_rank.update(survived=code is None, code=code)
            events.append({k: v for k, v in pending_rank.items() if k != "check_at"})
        soak.observe()
        soak.note_mappings()
        exit_code = soak.stop()
        soak.observe()
    finally:
        soak.kill_all()
    soak.tail.poll()
    return figures(args, soak, work, events, group_kills, host_died, exit_code)


def figures(args, soak: Soak, work: Path, events: list[dict], group_kills: int, host_died, exit_code) -> dict:
    """What the run came to."""
    rows = soak.tail.rows
    rounds = [r["round"] for r in rows]
    expected = list(range(1, max(rounds) + 1)) if rounds else []
    lost = sorted(set(expected) - set(rounds))
    seen: dict[int, int] = {}
    for r in rounds:
        seen[r] = seen.get(r, 0) + 1
    twice = sorted(r for r, n in seen.items() if n > 1)
    times = [r["round_seconds"] for r in rows if r.get("round_seconds") is not None]
    lifetimes = []
    for k, life in enumerate(soak.lifetimes):
        start_round = life["first_round"] or 0
        warm = [s for s in life["samples"] if s["round"] >= start_round + args.warmup]
        if warm and warm[-1]["round"] - warm[0]["round"] < MIN_SLOPE_ROUNDS:
            warm = []  # too few rounds after warm-up for a slope that means anything
        roles = sorted({r for s in warm for r in s["procs"]})
        procs = {}
        for role in roles:
            points = [(s["round"], s["procs"][role]) for s in warm if role in s["procs"]]
            procs[role] = {
                "pss_mib": [round(points[0][1]["pss_mib"], 1), round(points[-1][1]["pss_mib"], 1)],
                "pss_slope_mib_per_100_rounds": _slope_per_100([(r, p["pss_mib"]) for r, p in points]),
                "anon_slope_mib_per_100_rounds": _slope_per_100([(r, p["anon_mib"]) for r, p in points]),
                "anon_slope_error_mib_per_100_rounds": _slope_error_per_100([(r, p["anon_mib"]) for r, p in points]),
                "pss_floor_slope_mib_per_100_rounds": _floor_slope_per_100([(r, p["pss_mib"]) for r, p in points]),
                "anon_floor_slope_mib_per_100_rounds": _floor_slope_per_100([(r, p["anon_mib"]) for r, p in points]),
                "fds": [min(p["fds"] for _, p in points), max(p["fds"] for _, p in points)],
                "threads": [min(p["threads"] for _, p in points), max(p["threads"] for _, p in points)]}
        lifetimes.append({
            "restart": k > 0, "ended_by": life["ended_by"],
            "to_first_round_s": (life["first_round_at"] - life["started"]) if life["first_round_at"] else None,
            "resumed_to_first_round_s": (life["first_round_at"] - life["ready_at"])
            if life["first_round_at"] and life["ready_at"] else None,
            "rounds": (life["samples"][-1]["round"] - start_round) if life["samples"] else 0,
            "procs": procs, "mappings_grown_kib": life["mappings_grown"]})
    per_100 = []
    for bucket in range(0, (max(rounds) if rounds else 0) + 1, 100):
        inside = [t for t in soak.timeline if bucket < t["round"] <= bucket + 100]
        if not inside:
            continue
        roles = sorted({r for t in inside for r in t["pss_mib"]})
        per_100.append({"rounds": f"{bucket + 1}-{bucket + 100}",
                        "peak_pss_mib": {r: max(t["pss_mib"].get(r, 0) for t in inside) for r in roles},
                        "final_pss_mib": dict(inside[-1]["pss_mib"]),
                        "fds": [min(t["fds"] for t in inside), max(t["fds"] for t in inside)],
                        "threads": [min(t["threads"] for t in inside), max(t["threads"] for t in inside)]})
    restart_s = [life["to_first_round_s"] for life in lifetimes[1:] if life["to_first_round_s"] is not None]
    resumed_s = [life["resumed_to_first_round_s"] for life in lifetimes[1:]
                 if life["resumed_to_first_round_s"] is not None]
    return {
        "work": str(work), "aggregator_ranks": args.aggregator_ranks, "agents": args.agents,
        "agents_per_process": args.agents_per_process, "hostile": math.ceil(args.hostile * args.agents),
        "members": args.members, "deadline_s": args.deadline, "per_round": args.per_round,
        "agent_process_kills": group_kills, "events": events,
        "coordinator_kills": sum(e["kind"] == "coordinator kill" for e in events),
        "rank_kills": [e for e in events if e["kind"] == "rank kill"],
        "rounds": len(set(rounds)), "rounds_lost": lost, "rounds_twice": twice,
        "rounds_failed": sum(r.get("status") != "ok" for r in rows),
        "round_s_p50": _percentile(times, 0.5), "round_s_p99": _percentile(times, 0.99),
        "restart_to_first_round_s": restart_s, "resumed_to_first_round_s": resumed_s,
        "lifetimes": lifetimes, "per_100_rounds": per_100,
        "host_died": host_died, "sigterm_exit": exit_code,
        "summary_written": (work / "out" / "summary.json").exists(),
    }


def report(fig: dict) -> None:
    """Print the figures against the targets."""
    fmt = lambda v, f="+.3f": "-" if v is None else format(v, f)  # noqa: E731
    span = lambda v: "-" if not v else f"{v[0]}-{v[1]}"  # noqa: E731
    ranks = fig["rank_kills"]
    print(f"\nsoak: {fig['rounds']} rounds, {fig['aggregator_ranks']} aggregator rank(s), {fig['agents']} agents "
          f"({fig['hostile']} hostile, {fig['agents_per_process']} per process, {fig['agent_process_kills']} agent "
          f"processes killed), {fig['members']} hosted members, deadline {fig['deadline_s']} s; "
          f"{fig['coordinator_kills']} coordinator kill -9s, {len(ranks)} rank kill -9s "
          f"({sum(bool(e['survived']) for e in ranks)} survived by the coordinator); work dir {fig['work']}\n")
    print(f"{'lifetime':<9}{'ended by':<12}{'process':<10}{'rounds':>7}{'1st round s':>12}{'PSS MiB':>12}"
          f"{'MiB/100 r':>11}{'anon/100 r':>11}{'floor':>8}{'anon fl':>8}{'fds':>8}{'threads':>9}")
    for k, life in enumerate(fig["lifetimes"]):
        for role, p in life["procs"].items() or {"-": None}.items():
            pss = "-" if not p else f"{p['pss_mib'][0]:.0f}->{p['pss_mib'][1]:.0f}"
            print(f"{k:<9}{life['ended_by'] or 'SIGTERM':<12}{role:<10}{life['rounds']:>7}"
                  f"{fmt(life['to_first_round_s'], '.1f'):>12}{pss:>12}"
                  f"{fmt(p and p['pss_slope_mib_per_100_rounds']):>11}"
                  f"{fmt(p and p['anon_slope_mib_per_100_rounds']):>11}"
                  f"{fmt(p and p['pss_floor_slope_mib_per_100_rounds']):>8}"
                  f"{fmt(p and p['anon_floor_slope_mib_per_100_rounds']):>8}"
                  f"{span(p and p['fds']):>8}{span(p and p['threads']):>9}")
    print("\nper 100 rounds: peak / final PSS MiB of each process, the tree's fds and threads")
    for b in fig["per_100_rounds"]:
        print(f"  {b['rounds']:>11}  " + "  ".join(
            f"{r} {b['peak_pss_mib'][r]:.0f}/{b['final_pss_mib'].get(r, 0):.0f}" for r in b["peak_pss_mib"])
            + f"  fds {span(b['fds'])}  threads {span(b['threads'])}")
    for k, life in enumerate(fig["lifetimes"]):
        if life["mappings_grown_kib"]:
            print(f"lifetime {k}: coordinator PSS change after warm-up by mapping (KiB): "
                  + ", ".join(f"{n} {d:+d}" for n, d in life["mappings_grown_kib"].items()))
    slopes = [p["pss_slope_mib_per_100_rounds"] for life in fig["lifetimes"] for p in life["procs"].values()
              if p["pss_slope_mib_per_100_rounds"] is not None]
    anon = [p["anon_slope_mib_per_100_rounds"] for life in fig["lifetimes"] for p in life["procs"].values()
            if p["anon_slope_mib_per_100_rounds"] is not None]
    floors = [p["anon_floor_slope_mib_per_100_rounds"] for life in fig["lifetimes"] for p in life["procs"].values()
              if p["anon_floor_slope_mib_per_100_rounds"] is not None]
    print()
    if slopes:
        print(f"PSS slope after warm-up, any process and lifetime: median {statistics.median(slopes):+.3f}, max "
              f"{max(slopes):+.3f} MiB per 100 rounds (anonymous part: median {statistics.median(anon):+.3f}, max "
              f"{max(anon):+.3f}; target <= 0.03)")
    errors = [(role, p["anon_slope_mib_per_100_rounds"], p["anon_slope_error_mib_per_100_rounds"])
              for life in fig["lifetimes"] for role, p in life["procs"].items()
              if p["anon_slope_error_mib_per_100_rounds"] is not None]
    for role, slope, error in errors:
        print(f"{role}: anonymous slope {slope:+.3f} +- {error:.3f} MiB per 100 rounds (standard error from the means "
              f"of each {FLOOR_WINDOW} rounds)")
    if floors:
        print(f"slope of the anonymous part's floor (each {FLOOR_WINDOW} rounds' lowest sample: what is kept, not a "
              f"round's buffers in flight): median {statistics.median(floors):+.3f}, max {max(floors):+.3f} MiB per "
              "100 rounds")
    if fig["restart_to_first_round_s"]:
        r = fig["restart_to_first_round_s"]
        print(f"restart to first completed round: median {statistics.median(r):.1f} s, max {max(r):.1f} s "
              f"(target <= 8 s); from the log line saying it resumed (imports, ranks and checkpoint done): "
              + ", ".join(f"{v:.1f} s" for v in fig["resumed_to_first_round_s"]))
    print(f"round time p50 {fmt(fig['round_s_p50'], '.3f')} s, p99 {fmt(fig['round_s_p99'], '.3f')} s; "
          f"rounds failed {fig['rounds_failed']}")
    print(f"rounds lost: {len(fig['rounds_lost'])}, counted twice: {len(fig['rounds_twice'])} (target 0); "
          + ("" if not fig["members"] else "population host " + ("alive throughout; " if not fig["host_died"]
                                                                  else f"died: {json.dumps(fig['host_died'])}; "))
          + f"SIGTERM to the coordinator's PID: exit {fig['sigterm_exit']}, summary.json "
          f"{'written' if fig['summary_written'] else 'missing'}")


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print (and save) its figures."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1000, help="stop after this many rounds (0: run --minutes)")
    p.add_argument("--minutes", type=float, default=120.0, help="stop after this long at the latest")
    p.add_argument("--aggregator-ranks", type=int, default=2)
    p.add_argument("--agents", type=int, default=50, help="real agents")
    p.add_argument("--agents-per-process", type=int, default=5,
                   help="agents per process (1: each a `fedpar client` process; more: threads of one process)")
    p.add_argument("--leave-every", type=float, default=60.0,
                   help="mean seconds before an agent in a shared process leaves and joins again (0: never)")
    p.add_argument("--hostile", type=float, default=0.05, help="share of the agents that are abuse agents")
    p.add_argument("--members", type=int, default=0, help="members of a `fedpar simulate-workers` host (0: no host)")
    p.add_argument("--per-round", type=int, default=8, help="--clients-per-round and --min-available")
    p.add_argument("--deadline", type=float, default=0.5, help="the round's --deadline in seconds")
    p.add_argument("--churn-every", type=int, default=25, help="rounds between two agent-process kill -9s (0: none)")
    p.add_argument("--restarts", type=int, default=3, help="kill -9s of the coordinator")
    p.add_argument("--rank-kills", type=int, default=2, help="kill -9s of a non-zero aggregator rank")
    p.add_argument("--warmup", type=int, default=100, help="rounds of each lifetime left out of the PSS slope")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--coordinator-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in the coordinator's environment (e.g. MALLOC_ARENA_MAX=2), to compare")
    p.add_argument("--quick", action="store_true", help="smoke run: 150 rounds, 10 agents, 1 kill of each kind")
    p.add_argument("--json", type=Path, default=RESULTS / "soak.json", help="where the figures go")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.agents, args.restarts, args.rank_kills, args.warmup = 150, 10, 1, 1, 30
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped soak still kills what it started
    fig = run(args)
    report(fig)
    restarts, p50 = fig["restart_to_first_round_s"], fig["round_s_p50"]
    ratios = [{"what": "p99 round time", "ratio": fig["round_s_p99"] / p50,
               "against": "the p50 round of the same run"}] if p50 else []
    if restarts and p50:
        ratios.append({"what": "restart to first completed round", "ratio": statistics.median(restarts) / p50,
                       "against": "the p50 round of the same run"})
    path = write_results(args.json, ratios, fig, argv=[sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
