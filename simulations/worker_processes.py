"""The simulation's worker processes: each hosts its slice of the population (simulations/agents.py) once the
WorkerConfig of that slice comes down its pipe.

Where this process may fork (parallel/init.fork_safe: one thread, no GPU), they are forked from it once it has
imported torch and fedpar's client side, so that none imports them again (about 1.6 s of CPU each on this machine,
which two workers spent beside the coordinator's own import on two cores). Where it may not (it runs threads, or has
served gRPC: a notebook, a test) they are forked from multiprocessing's fork server, which imports them once for
every later run of this process; spawned, each importing them itself, only off Linux or with a GPU visible.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from multiprocessing.connection import Connection

from fedpar.datasets.memory import check_fits
from fedpar.datasets.registry import check_dataset_fits, full_dataset_name
from fedpar.parallel.child_logs import LauncherSide, launcher_side, own_standard_streams
from fedpar.parallel.stopping import interrupts_held, parent_stops_this
from fedpar.simulations.config import SimulationConfig

# What a run needs, for the one line that says so before it starts (measured: benchmarks/population_bench.py)
PROCESS_BYTES = 320 << 20  # a coordinator or worker process, torch and gRPC loaded, before its members
MEMBER_BYTES = 300  # each member's bookkeeping: the coordinator's arrays and its host's (measured: 204-256)


class WorkerProcesses:
    """``count`` worker processes, started now, each loading ``preload`` (a dataset name; None: a task or Flower App
    loads its own) from ``data_dir`` until its slice arrives on its pipe (:attr:`sends`)."""

    def __init__(self, count: int, preload: str | None, data_dir: str | None):
        self.started = time.monotonic()
        method = start_method()
        ctx = mp.get_context(method)
        pipes = [ctx.Pipe(duplex=False) for _ in range(count)]
        say = one_turn(ctx)  # a task that fails every worker alike is said once
        # the workers' temporary files (their members' top-k residuals: a model each): removed here with the workers,
        # however they end (an interrupted run terminates them, which skips their own clean-up)
        self.scratch = tempfile.mkdtemp(prefix="fedpar-simulation-")
        sends = [send for _, send in pipes]
        self.procs = [ctx.Process(target=run_worker_entry, name=f"fedpar-worker-{w}",
                                  args=(recv, preload, data_dir, say, self.scratch,
                                        others(pipes, w) if method == "fork" else [], launcher_side(method)),
                                  daemon=True)
                      for w, (recv, _) in enumerate(pipes)]
        with interrupts_held(method):  # this process stops them, so an interrupt prints no worker tracebacks
            for p in self.procs:
                p.start()
        for recv, _ in pipes:
            recv.close()  # the child's end
        say.close()
        self.sends: list[Connection] = sends
        self.closed = False

    def close(self, wait: bool) -> None:
        """Call off the workers that got no slice and end them all: with ``wait``, each is given 5 s to finish by
        itself first (a run that ended normally); else they are terminated at once. Closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        for send in self.sends:
            if not send.closed:
                try:
                    send.send(None)  # called off before this worker got its slice
                except OSError:
                    pass  # that worker is gone already
        for p in self.procs:
            if wait:
                p.join(timeout=5)
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)  # a terminated worker ends at once: then nothing writes in its scratch folder
        shutil.rmtree(self.scratch, ignore_errors=True)


def start_workers(cfg: SimulationConfig) -> WorkerProcesses:
    """The worker processes ``cfg`` (settled) runs on, started: each preloads the run's dataset unless a task or a
    Flower App loads its own."""
    return WorkerProcesses(cfg.workers, preloaded_dataset(cfg), cfg.data_dir)


def preloaded_dataset(cfg: SimulationConfig) -> str | None:
    """The dataset ``cfg``'s workers load as they start (None: a task or a Flower App loads its own); ValueError for a
    name no dataset has (synthetic:1), or for a population or data this machine's memory cannot hold (said before
    any worker starts: each would fail alike, with a traceback)."""
    check_population_fits(cfg)
    return None if cfg.task or cfg.flower_app else full_dataset_name(cfg.dataset, cfg.clients)


def check_population_fits(cfg: SimulationConfig) -> None:
    """ValueError, one line saying how much memory the population needs (and the data its dataset makes in each
    process, for a dataset that says: synthetic), when this machine has less free."""
    check_fits(PROCESS_BYTES * (cfg.workers + 1) + MEMBER_BYTES * cfg.clients,
               f"a population of {cfg.clients:,} clients in {cfg.workers} worker processes",
               "use fewer --clients, or spread them over machines with fedpar simulate-workers under torchrun")
    if not (cfg.task or cfg.flower_app):  # else no process loads --dataset
        check_dataset_fits(full_dataset_name(cfg.dataset, cfg.clients), cfg.workers + 1, cfg.partition)


def start_method() -> str:
    """'fork' where this process may fork the workers (parallel/init.rank_start_method), the modules they run
    imported here first; else 'forkserver' (Linux, no GPU: forked from a helper that imported them once) or
    'spawn'."""
    from fedpar.parallel.init import rank_start_method

    method = rank_start_method()
    if method == "fork":
        importlib.import_module("fedpar.simulations.agents")  # the forked workers start with it, torch and gRPC loaded
    return method


def others(pipes: list[tuple[Connection, Connection]], worker: int) -> list[Connection]:
    """The pipe ends a worker forked with ``pipes`` holds and must close: every sending end (so that a closed one
    reads as the end) and the other workers' receiving ends."""
    return [send for _, send in pipes] + [recv for w, (recv, _) in enumerate(pipes) if w != worker]


def run_worker_entry(conn: Connection, dataset: str | None, data_dir: str | None, say: Connection,
                     scratch: str, inherited: list[Connection], launcher: LauncherSide | None = None) -> None:
    """Process target: simulations/agents.py's worker (imported here, in a spawned child), its temporary files in
    ``scratch``, which the parent removes; a forked child first closes the pipe ends it ``inherited`` and puts back
    the default stops its parent had changed; a fork server's child takes the ``launcher``'s streams and
    environment."""
    parent_stops_this()
    own_standard_streams(launcher)
    for end in inherited:
        end.close()
    tempfile.tempdir = scratch
    from fedpar.simulations.agents import run_worker_process

    run_worker_process(conn, dataset, data_dir, say)


def one_turn(ctx) -> Connection:
    """What the worker processes (started from ``ctx``) share to let one of them, the first to ask, speak: a pipe
    holding one byte, its writing end closed (no lock: a byte read from a pipe is one reader's)."""
    turn, give = ctx.Pipe(duplex=False)
    os.write(give.fileno(), b".")
    give.close()
    return turn
