"""The timeline of a steady round of `fedpar simulate` (issue 25's 10-of-100 cell: digits MLP, one local epoch): when
each hop happens, on the coordinator and in the worker processes, from the round's start.

One command: ``.venv/bin/python benchmarks/round_timeline.py`` (``--clients 100 --clients-per-round 10 --rounds 12``
and any other `fedpar simulate` flags after ``--``). It runs `fedpar simulate --quiet` with this folder on
PYTHONPATH and a ``sitecustomize`` that imports this module's :func:`install` in every process (the coordinator's
and the spawned workers'): it wraps the functions of HOPS as their modules are imported, each noting
``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process of the machine) and its thread's CPU time
(``time.thread_time()``) on entry and/or exit into one file per process. Nothing in fedpar changes; without this benchmark nothing is wrapped.

Each event belongs to the round whose start (``Coordinator._run_round``) precedes it; for every hop it prints the
median over rounds 2..R of the first and the last time it happened in the round, in milliseconds from the round's
start (and for a hop noted on entry and exit the milliseconds spent in it and the CPU milliseconds its thread used
meanwhile, each summed over the round's calls: the difference is waiting, for a core or the interpreter lock), and
the cycle: from a round's start to the next one's.
It also pairs each host's partial upload with its own hops: from its message being ready to the coordinator's checks
(the transport), the checks and fold, and back to the host. ``--baseline PYTHON`` (another checkout's venv python;
a hop its code lacks is not noted) alternates ``--pairs`` runs of that checkout's code with this one's and prints
those three per checkout and their ratios.
The results go to benchmarks/results/round_timeline.json (``--json``).

``--checkpoints`` runs the same job a second time with a checkpoint every round (``--checkpoint-dir``, as `fedpar
serve` keeps one) and prints its cycle against the first run's, the same-run ratio (a checkpoint is written beside
the next round, so it costs a round little while it is shorter than one).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import functools
import importlib.abc
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results import write_results  # noqa: E402  (benchmarks/, this script's folder)

from fedpar.cli.argtypes import FedparParser  # noqa: E402
ENV = "FEDPAR_ROUND_TIMELINE"  # the folder each process writes its events to (set only by this benchmark)
START = "server Coordinator._run_round"  # the event that starts a round

# module -> (qualified function, side, what to note: "in", "out" or "both"; "out?": on exit when it returned tasks)
HOPS = {
    "fedpar.server.coordinator": [("Coordinator._run_round", "server", "in"),
                                  ("Coordinator._finish_round", "server", "in"),
                                  ("Coordinator._in_thread", "server", "both"),
                                  ("Coordinator._model_work", "server", "both"),
                                  ("Coordinator._publish_payload", "server", "both")],
    "fedpar.server.members": [("Members.wait_for_live", "server", "both"), ("Members.live_ids", "server", "both"),
                              ("CohortSampler.sample", "server", "both")],
    "fedpar.server.populations": [("Populations.deal", "server", "in"),
                                  ("Populations._reply", "server", "out?")],
    "fedpar.server.app": [("CoordinatorService._host_uploads", "server", "both"),
                          ("CoordinatorService._host_tasks", "server", "in")],
    "fedpar.server.rounds": [("RoundState.close", "server", "in")],
    "fedpar.server.round_modes": [("PlainRound.close", "server", "both"), ("RoundModes.for_round", "server", "both"),
                                  ("take_host_partial", "server", "both")],
    "fedpar.server.uploads": [("check_partial", "server", "both")],
    "fedpar.protocol.run_logs": [("RoundMetricsLog.append", "server", "both")],
    "fedpar.client.links": [("HostLink.pull", "worker", "out?")],
    "fedpar.client.runtime": [("ClientRuntime._dispatch", "worker", "in"),
                              ("ClientRuntime.run_task", "worker", "in"),
                              ("ClientRuntime._round_weights", "worker", "out"),
                              ("ClientRuntime._evaluation", "worker", "both")],
    "fedpar.client.task_trainer": [("TaskTrainer.train", "worker", "both"),
                                   ("TaskTrainer.set_arrays", "worker", "both"),
                                   ("TaskTrainer.use_data", "worker", "both")],
    "fedpar.client.transfer": [("task_weights", "worker", "both"), ("PlainUpload.upload", "worker", "in")],
    "fedpar.simulations.population": [("PopulationMembers.member_data", "worker", "both")],
    "fedpar.client.host_uploads": [("HostUploads._send", "worker", "both"), ("HostUploads.nudge", "worker", "in"),
                                   ("HostUploads._sum_into", "worker", "both")],
    "fedpar.client.host_partial": [("HostSum.message", "worker", "both")],
    "fedpar.server.limits": [("RpcLimit._request", "server", "both")],
}


# ----------------------------------------------------------------------------- in every process (sitecustomize)
class _Log:
    """This process's events, one line each: monotonic seconds, the thread's CPU seconds, the thread, the name."""

    def __init__(self, folder: str):
        self.file = open(Path(folder) / f"{os.getpid()}.events", "a", buffering=1)

    def note(self, name: str) -> None:
        self.file.write(f"{time.monotonic():.7f} {time.thread_time():.7f} {threading.get_ident()} {name}\n")


def _returned_tasks(result) -> bool:
    return bool(getattr(result, "tasks", None))


def _called(fn) -> str:
    """The name of the function ``fn`` runs (through a partial)."""
    fn = getattr(fn, "func", fn)
    return getattr(fn, "__qualname__", type(fn).__name__).rpartition(".")[2]


def _wrap(fn, name: str, what: str, log: _Log):
    """``fn`` noting its entry and/or exit as ``name`` (an exit named by the function called, for _in_thread)."""
    label = (lambda args: f"{name} {_called(args[1])}") if name.endswith(("_in_thread", "_model_work")) \
        else (lambda args: name)
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped(*args, **kwargs):
            if what in ("in", "both"):
                log.note(f"{label(args)}{' in' if what == 'both' else ''}")
            result = await fn(*args, **kwargs)
            if what == "both" or what == "out" or (what == "out?" and _returned_tasks(result)):
                log.note(f"{label(args)}{' out' if what == 'both' else ''}")
            return result
        return wrapped

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if what in ("in", "both"):
            log.note(f"{label(args)}{' in' if what == 'both' else ''}")
        result = fn(*args, **kwargs)
        if what == "both" or what == "out" or (what == "out?" and _returned_tasks(result)):
            log.note(f"{label(args)}{' out' if what == 'both' else ''}")
        return result
    return wrapped


class _Patcher(importlib.abc.MetaPathFinder):
    """Wraps HOPS' functions in each module of HOPS right after it is executed."""

    def __init__(self, log: _Log):
        self.log = log

    def find_spec(self, fullname, path, target=None):
        if fullname not in HOPS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute, log = spec.loader.exec_module, self.log

        def exec_module(module):
            execute(module)
            for qualname, side, what in HOPS[fullname]:
                owner_name, _, fn_name = qualname.rpartition(".")
                owner = getattr(module, owner_name) if owner_name else module
                if hasattr(owner, fn_name):  # another checkout's code may lack a hop (a comparison run)
                    setattr(owner, fn_name, _wrap(getattr(owner, fn_name), f"{side} {qualname}", what, log))
        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Wrap HOPS in this process when the benchmark asked (``FEDPAR_ROUND_TIMELINE`` names its folder)."""
    folder = os.environ.get(ENV)
    if folder:
        sys.meta_path.insert(0, _Patcher(_Log(folder)))


# ----------------------------------------------------------------------------- the benchmark
def read_events(folder: Path) -> list[tuple[float, str, str, float]]:
    """Every process's events (time, name, process:thread, the thread's CPU seconds), in time order."""
    events = []
    for path in folder.glob("*.events"):
        for line in path.read_text().splitlines():
            t, cpu, thread, name = line.split(" ", 3)
            events.append((float(t), name, f"{path.stem}:{thread}", float(cpu)))
    return sorted(events)


def timeline(events: list[tuple[float, str, str, float]], skip: int = 1) -> dict[str, dict[str, float]]:
    """Per hop: the median over rounds (the first ``skip`` left out; the last, cut short by the end, too) of its
    first and last time in the round in ms from the round's start, how often it happened in a round, and for a
    hop noted on entry and exit the ms spent in it per round and the CPU ms its thread used meanwhile (each summed
    over its calls, each thread's paired: under load a hop's time is more than its CPU, the rest waiting for a
    core or the interpreter lock)."""
    starts = [t for t, name, _, _ in events if name == START]
    per_round: list[dict[str, list[float]]] = [collections.defaultdict(list) for _ in starts]
    spent: list[dict[str, float]] = [collections.defaultdict(float) for _ in starts]
    used: list[dict[str, float]] = [collections.defaultdict(float) for _ in starts]
    entered: dict[tuple[str, str], tuple[float, float]] = {}
    r = -1
    for t, name, thread, cpu in events:
        while r + 1 < len(starts) and t >= starts[r + 1]:
            r += 1
        if name.endswith(" in"):
            entered[(thread, name[:-3])] = (t, cpu)
        elif name.endswith(" out") and (thread, name[:-4]) in entered and r >= 0:
            t0, cpu0 = entered.pop((thread, name[:-4]))
            spent[r][name[:-4]] += (t - t0) * 1000
            used[r][name[:-4]] += (cpu - cpu0) * 1000
        if r >= 0:
            per_round[r][name].append((t - starts[r]) * 1000)
    rounds, spent, used = per_round[skip:-1], spent[skip:-1], used[skip:-1]
    names = sorted({n for rd in rounds for n in rd}, key=lambda n: statistics.median(
        rd[n][0] for rd in rounds if n in rd))
    out = {n: {"first_ms": statistics.median(rd[n][0] for rd in rounds if n in rd),
               "last_ms": statistics.median(rd[n][-1] for rd in rounds if n in rd),
               "count": statistics.median(len(rd[n]) for rd in rounds if n in rd),
               "rounds": sum(n in rd for rd in rounds)} for n in names}
    for n in out:
        if n.endswith(" out"):
            out[n]["spent_ms"] = statistics.median(sp.get(n[:-4], 0.0) for sp in spent)
            out[n]["cpu_ms"] = statistics.median(u.get(n[:-4], 0.0) for u in used)
    return out


def cycle_ms(events: list[tuple[float, str, str, float]], skip: int = 1) -> float:
    """The median time from one round's start to the next one's (rounds after the first ``skip``)."""
    starts = [t for t, name, _, _ in events if name == START][skip:]
    return statistics.median((b - a) * 1000 for a, b in zip(starts, starts[1:]))


def upload_trip(events: list[tuple[float, str, str, float]], skip: int = 1) -> dict[str, float]:
    """A host's partial upload, each paired with its own hops (rounds after the first ``skip``): median ms from the
    partial's message being ready on the host to the coordinator starting its checks (the transport), the checks and
    the fold, and from the handler's end to the host holding the results."""
    start = [t for t, name, _, _ in events if name == START][skip] \
        if skip < sum(n == START for _, n, _, _ in events) else 0
    times = collections.defaultdict(list)
    for t, name, thread, _ in events:
        times[name].append(t)
        times[f"{name} @{thread}"].append(t)

    def after(name: str, t: float) -> float | None:
        at = bisect.bisect_left(times[name], t)
        return times[name][at] if at < len(times[name]) else None
    trips = collections.defaultdict(list)
    for t, name, thread, _ in events:
        if name != "worker HostSum.message out" or t < start:
            continue
        checks = after("server take_host_partial in", t)
        checked = checks and after("server take_host_partial out", checks)
        back = after(f"worker HostUploads._send out @{thread}", t)
        if checks and checked and back and checked <= back:
            trips["to the coordinator's checks"].append((checks - t) * 1000)
            trips["checks and fold"].append((checked - checks) * 1000)
            trips["back to the host"].append((back - checked) * 1000)
    return {k: statistics.median(v) for k, v in trips.items()} | {"uploads": len(trips["checks and fold"])}


def run(simulate_args: list[str], out: Path, python: str = sys.executable) -> tuple[dict, float, list[dict], dict]:
    """One traced `fedpar simulate` run (``python``: a venv's, whose checkout's code runs): its timeline, its
    round-to-round cycle in ms, its metrics rows and its hosts' upload trip."""
    events = out / "events"
    events.mkdir(parents=True)
    (out / "sitecustomize.py").write_text("import round_timeline\nround_timeline.install()\n")
    env = {**os.environ, ENV: str(events),
           "PYTHONPATH": os.pathsep.join([str(out), str(HERE), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([python, "-m", "fedpar", "simulate", *simulate_args, "--out", str(out / "run"),
                    "--quiet"], env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    traced = read_events(events)
    return timeline(traced), cycle_ms(traced), rows, upload_trip(traced)


def main() -> int:
    """Run, print the table, write the JSON."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--clients-per-round", type=int, default=10)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--json", type=Path, default=HERE / "results" / "round_timeline.json")
    p.add_argument("--checkpoints", action="store_true",
                   help="also run with a checkpoint every round and print its cycle against the run without")
    p.add_argument("--baseline", help="another checkout's venv python: alternate its runs with this one's and print "
                                      "the hosts' upload trip of each (the timeline is this checkout's last run)")
    p.add_argument("--pairs", type=int, default=3, help="alternated runs of each with --baseline")
    p.add_argument("simulate", nargs="*", help="more `fedpar simulate` flags (after --)")
    a = p.parse_args()
    args = ["--dataset", "digits", "--model", "mlp", "--local-epochs", "1", "--rounds", str(a.rounds),
            "--clients", str(a.clients), "--clients-per-round", str(a.clients_per_round), *a.simulate]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    checkpointed = None
    trips: dict[str, list[dict]] = {"baseline": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(a.pairs if a.baseline else 0):
            trips["baseline"].append(run(args, Path(tmp) / f"baseline{pair}", a.baseline)[3])
            trips["this"].append(run(args, Path(tmp) / f"this{pair}")[3])
        hops, cycle, rows, trip = run(args, Path(tmp) / "plain")
        if a.checkpoints:
            checkpointed = run([*args, "--checkpoint-dir", str(Path(tmp) / "ckpt")], Path(tmp) / "checkpointed")
    round_ms = statistics.median(r["round_seconds"] for r in rows[1:]) * 1000
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"fedpar simulate {' '.join(args)}; load average {' '.join(load_before)} before, {' '.join(load)} after")
    print(f"round start to the next round's start: {cycle:.1f} ms; a round's own round_seconds (its start to its "
          f"metrics row): {round_ms:.1f} ms (medians from round 2)")
    ratios, extra = [], {}
    if checkpointed is not None:
        extra = {"checkpointed_cycle_ms": checkpointed[1], "checkpointed_hops": checkpointed[0]}
        ratios.append({"what": "10-of-100 round cycle of fedpar simulate with a checkpoint every round",
                       "ratio": checkpointed[1] / cycle, "against": "the same job without checkpoints, same run"})
        spent = checkpointed[0].get("server Coordinator._in_thread _checkpoint out", {}).get("spent_ms")
        print(f"with --checkpoint-dir: {checkpointed[1]:.1f} ms a cycle, {checkpointed[1] / cycle:.2f}x the cycle "
              f"without" + (f"; writing a checkpoint takes {spent:.1f} ms" if spent is not None else ""))
    print("a host's partial upload (medians over its uploads, ms): " + "; ".join(
        f"{k} {v:.2f}" for k, v in trip.items() if k != "uploads"))
    if a.baseline:
        print(f"alternated with {a.baseline}, {a.pairs} runs each (median of the runs' medians, ms):")
        for key in [k for k in trip if k != "uploads"]:
            base, this = (statistics.median(t[key] for t in trips[w]) for w in ("baseline", "this"))
            print(f"  {key:<30} baseline {base:6.2f}  this {this:6.2f}  {this / base:.2f}x")
            ratios.append({"what": f"a host's partial upload, {key}", "ratio": this / base,
                           "against": f"{a.baseline}'s code, alternated runs, same machine"})
        extra["upload_trips"] = trips
    print(f"{'hop':<56}{'first ms':>9}{'last ms':>9}{'times':>7}{'spent ms':>9}{'CPU ms':>8}")
    for name, h in hops.items():
        spent = f"{h['spent_ms']:>9.2f}{h['cpu_ms']:>8.2f}" if "spent_ms" in h else ""
        print(f"{name:<56}{h['first_ms']:>9.2f}{h['last_ms']:>9.2f}{h['count']:>7.0f}{spent}")
    write_results(a.json, ratios, {"simulate_args": args, "cycle_ms": cycle, "round_seconds_ms": round_ms, "hops": hops,
                                   "upload_trip": trip,
                                   "load_average_before": load_before, "load_average_after": load, **extra})
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
