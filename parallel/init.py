"""Process-group start-up: backend and device choice, torchrun environment, and a local spawn launcher."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import secrets

from fedpar.parallel.child_logs import LauncherSide, launcher_side, own_standard_streams
from fedpar.parallel.device import backend_for, resolve_device
from fedpar.parallel.rendezvous import bound_store, gloo_on_loopback
from fedpar.parallel.restarts import NAMESPACE_ENV, REPLACEMENT_ENV, RestartBudget
from fedpar.parallel.stopping import StopRequested, default_terminate, die_with_parent, dump_stacks_on_signal, \
    interrupts_held, parent_stops_this, raise_lost_stop, stop_on_signals
from fedpar.ports import ReservedPort

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, local rank, world size, backend and device."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the only rank that logs and writes run outputs."""
        return self.rank == 0


_joined: DistInfo | None = None  # what init_distributed set up in this process
# Set ("1") by spawn() for ranks whose launcher holds their rendezvous store; torch's own TORCHELASTIC_USE_AGENT_STORE
# would be inherited by every group and process after them (a simulation's gloo ranks then found no store).
LAUNCHER_STORE_ENV = "FEDPAR_LAUNCHER_STORE"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # set by torchrun: its agent serves the rendezvous store


def init_distributed(timeout_seconds: float = 300.0, device: str = "auto") -> DistInfo:
    """Join (or create) the default process group from torchrun-style environment variables.

    ``device`` is the ``--device`` choice (see parallel/device.py): NCCL with ``cuda:LOCAL_RANK`` on GPUs, gloo on
    the CPU. Without WORLD_SIZE in the environment this is a one-process group on an in-memory store, so
    single-process training runs the same code path without opening a port.
    """
    global _joined
    if _joined is not None and dist.is_initialized():
        return _joined  # already joined: the device chosen then stays (a second ``auto`` must not move it)
    timeout = timedelta(seconds=timeout_seconds)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = resolve_device(device, local_rank)
    backend = backend_for(torch_device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise RuntimeError(f"WORLD_SIZE is set but {', '.join(missing)} is not; launch with torchrun "
                                   "or 'fedpar train --nproc N', or unset WORLD_SIZE for one process")
            # device_id binds NCCL's communicator to this rank's GPU at once (no guessing from the current device).
            extra = {"device_id": torch_device} if backend == "nccl" else {}
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            gloo_on_loopback(host)
            launcher_holds = os.environ.pop(LAUNCHER_STORE_ENV, None) == "1"  # read once: no later child inherits it
            if not launcher_holds and os.environ.get(AGENT_STORE_ENV) == "True":  # torchrun's agent serves the store
                dist.init_process_group(backend, timeout=timeout, **extra)
            else:
                store = _store(host, port, world, rank == 0 and not launcher_holds, timeout)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **extra)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    _joined = DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), dist.get_backend(), torch_device)
    return _joined


def join_gloo_group(rank: int, world_size: int, port: int, timeout_seconds: float, host: str = "127.0.0.1") -> None:
    """Join a gloo group of ``world_size`` processes whose rank 0 listens on ``host:port`` (processes started by
    their own launcher, e.g. `fedpar simulate`'s aggregator ranks, not torchrun)."""
    timeout = timedelta(seconds=timeout_seconds)
    gloo_on_loopback(host)
    store = _store(host, port, world_size, rank == 0, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def _store(host: str, port: int, world_size: int, serve: bool, timeout: timedelta) -> dist.TCPStore:
    """The group's rendezvous store on ``host:port``: served here, on that address alone, when ``serve`` (rank 0),
    else reached there; RuntimeError in one line if it cannot listen there."""
    if not serve:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    try:
        return bound_store(host, port, timeout, world_size)
    except OSError as exc:
        raise RuntimeError(f"rank 0 cannot listen for the other ranks on {host}:{port} (MASTER_ADDR, MASTER_PORT): "
                           f"{exc.strerror or exc}") from None


def shutdown_distributed() -> None:
    """Destroy the default process group if there is one."""
    global _joined
    _joined = None
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank_process(code: int = 0) -> None:
    """End a finished rank process at once, skipping the interpreter's and C++ libraries' teardown.

    Call it only after the process group is destroyed and every output is closed. A gloo rank that exits
    normally sometimes aborts in that teardown ("terminate called without an active exception", SIGABRT,
    with no Python frame left on the stack) after all its work succeeded: about 1 exit in 40 on 2 busy cores
    (also pytorch#190489 and the abandoned pytorch#179291). The launcher would then report a failed run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawned_worker(local_rank: int, nproc: int, port: int, fn: Callable[..., Any], args: tuple,
                    parent_stops: bool = False, env: dict[str, str] | None = None,
                    launcher: LauncherSide | None = None) -> None:
    if parent_stops:  # the launcher stops this rank: Ctrl-C is ignored; still leave when the launcher dies
        parent_stops_this()
        die_with_parent(signal.SIGTERM)
    else:
        default_terminate()  # ended by SIGTERM as a spawned one is (not by its launcher's handler, copied)
    own_standard_streams(launcher)  # forked: where a spawned rank would write
    dump_stacks_on_signal()
    os.environ.pop(LAUNCHER_STORE_ENV, None)  # a launcher's own launcher's store is not this launch's
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env or {}))
    # Several ranks share few cores: one intra-op thread each avoids oversubscription (torchrun does the same).
    torch.set_num_threads(1)
    fn(*args)
    shutdown_distributed()  # in case fn left the group up
    exit_rank_process(0)  # an exception above takes torch's path instead: traceback to the parent, exit code 1


def spawn(nproc: int, fn: Callable[..., Any], *args: Any, parent_stops: bool = False,
          stop_grace: float = 1.0, rank_0_decides: bool = False, start_method: str = "spawn",
          rank_0_resumes: bool = False, restarts: RestartBudget | None = None,
          on_rank_lost: Callable[[], None] | None = None) -> None:
    """Run ``fn(*args)`` in ``nproc`` fresh local processes set up like torchrun workers on 127.0.0.1.

    ``fn`` must be importable (a module-level function); a failure in any rank is re-raised here. With
    ``parent_stops`` the ranks ignore Ctrl-C and leave when this process dies; SIGINT or SIGTERM here stops them
    (:func:`stop_ranks`, rank 0 given ``stop_grace`` seconds) before LaunchStopped is raised: the caller then says
    what completed, and no rank prints a traceback of its own (a :class:`LaunchStopped` says whether rank 0 could).
    A second signal kills them and exits at once.
    With ``rank_0_decides`` (and ``parent_stops``) another rank may die without ending the others (rank 0 goes on
    without it: aggregator ranks), and a fresh process is started in its slot (parallel/restarts.py: it asks rank 0
    to take it back); the launch ends when rank 0 does, and only rank 0's failure is re-raised. With
    ``rank_0_resumes`` (rank 0 keeps a checkpoint) rank 0's death by a signal (``kill -9``, a crash) starts every
    rank again, as the same command would, within the same restart budget (`fedpar simulate` launches its coordinator
    alone so: ``nproc`` 1). ``restarts``: that budget, shared by every slot (default: parallel/restarts.py's).
    ``start_method`` "fork" starts the ranks as copies of this process (no interpreter start or imports: seconds on
    a loaded machine); only for a caller that has started no threads, gRPC or CUDA (see :func:`fork_safe`).
    ``on_rank_lost`` (with ``parent_stops``, where ranks end together) is called once a rank has failed, before
    torch's join stops the others with SIGTERM: a rank 0 that says what it did on a stop can then tell the two apart.
    """
    if nproc < 1:
        raise ValueError("nproc must be at least 1")
    # A launch whose ranks all start and end together meets at a store this launcher holds, as torchrun's agent
    # does: it binds a free port itself, so nothing can take the port between its choice and rank 0's bind
    # (EADDRINUSE, seen on a busy 16-core box). Where rank 0 outlives lost ranks or starts again, it holds the store
    # (a replacement rank meets it there) on a port this launcher keeps reserved for every start of rank 0; a forked
    # rank would inherit the store's thread-less server.
    held = None if rank_0_decides or rank_0_resumes or start_method == "fork" else _launcher_store()
    with _meeting_port(held) as port:
        if not parent_stops:  # `held` serves until this function returns
            mp.start_processes(_spawned_worker, args=(nproc, port, fn, args, False, _store_env(held),
                                                      launcher_side(start_method)),
                               nprocs=nproc, join=True, start_method=start_method)
            return
        budget = restarts or RestartBudget()
        while True:
            env = {NAMESPACE_ENV: f"fedpar/ranks/{secrets.token_hex(4)}"} if rank_0_decides else _store_env(held)
            context = None
            with stop_on_signals(on_second=lambda: [p.kill() for p in (context.processes if context else ())
                                                    if p.is_alive()]):
                try:
                    with interrupts_held(start_method):  # a Ctrl-C that comes while they start stops them after
                        context = mp.start_processes(_spawned_worker, args=(nproc, port, fn, args, True, env,
                                                                            launcher_side(start_method)),
                                                     nprocs=nproc, join=False, start_method=start_method)
                    if not (rank_0_decides or rank_0_resumes):
                        while not _ranks_joined(context, on_rank_lost):
                            raise_lost_stop()
                    elif _follow_rank_0(context, partial(_start_replacement, nproc=nproc, port=port, fn=fn, args=args,
                                                         env=env, start_method=start_method), budget, rank_0_resumes):
                        continue  # rank 0 died and resumes: every rank again
                except KeyboardInterrupt as exc:
                    if context is not None:
                        stop_ranks(context.processes, stop_grace)
                    # A rank 0 that this stop ended before it took stops itself (a spawned rank still starts its
                    # interpreter and imports torch: seconds), or that a signal had ended just before (kill -9, then
                    # Ctrl-C at once), said nothing of it; the caller may say it instead.
                    exitcode = None if context is None else context.processes[0].exitcode
                    silent = exitcode is None or exitcode < 0
                    signum = exc.signum if isinstance(exc, StopRequested) else signal.SIGINT
                    raise LaunchStopped(signum, silent) from None
            return


def _ranks_joined(context: mp.ProcessContext, on_rank_lost: Callable[[], None] | None) -> bool:
    """``context.join`` for half a second; with ``on_rank_lost``, called first when a rank has failed (torch's join
    then stops the other ranks and raises)."""
    if on_rank_lost is None:
        return context.join(timeout=0.5)
    live = [p.sentinel for p in context.processes if p.exitcode is None]
    ended = wait(live, timeout=0.5) if live else []
    if live and not ended:  # none ended in this half second: torch's join now could see one end before this does
        return False
    for process in context.processes:
        if process.sentinel in ended:
            process.join()  # its sentinel closes a moment before its exit code can be read
    if any(p.exitcode for p in context.processes):
        on_rank_lost()
    return context.join(timeout=0)


class LaunchStopped(StopRequested):
    """A signal stopped a launch's ranks; ``rank_0_said_nothing``: rank 0 never started, or the stop ended it
    before it took signals itself, so it did not say what completed."""

    def __init__(self, signum: int, rank_0_said_nothing: bool):
        super().__init__(signum)
        self.rank_0_said_nothing = rank_0_said_nothing


def _launcher_store() -> dist.TCPStore:
    """A rendezvous store on a port of its own choosing on 127.0.0.1, served by this process for its ranks."""
    return bound_store("127.0.0.1", 0, timedelta(seconds=300))


@contextmanager
def _meeting_port(store: dist.TCPStore | None) -> Iterator[int]:
    """The port the ranks meet at while the block runs: ``store``'s, else one reserved here that rank 0 binds (at
    each of its starts)."""
    if store is not None:
        yield store.port
        return
    with ReservedPort() as port:
        yield port


def _store_env(store: dist.TCPStore | None) -> dict[str, str]:
    """What tells :func:`init_distributed` in every rank to meet at the launcher's ``store`` (rank 0 binds none)."""
    return {LAUNCHER_STORE_ENV: "1"} if store is not None else {}


def fork_safe() -> bool:
    """Whether processes may be forked from this one: on Linux (macOS's system libraries do not survive a fork, which
    is why Python spawns there), no GPU is visible (CUDA does not survive one either), only this one thread runs
    Python (a lock another thread held would stay locked in the copy) and gRPC has started no thread here."""
    import threading

    return (sys.platform.startswith("linux") and threading.active_count() == 1 and not _grpc_threads()
            and not torch.cuda.is_available())


GRPC_THREADS = ("grpc", "event_engine", "lifeguard")  # gRPC core's threads, by name (its timer outlives its servers)


def _grpc_threads() -> bool:
    """Whether gRPC's core runs threads in this process (they are no Python threads; a copy made by fork has none of
    them, and gRPC there may wait for a timer that never fires)."""
    for task in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text()
        except OSError:  # that thread ended meanwhile
            continue
        if name.startswith(GRPC_THREADS):
            return True
    return False


# What a fork server imports once, before it forks each child: torch, gRPC and fedpar's workers and ranks; the last,
# how the server leaves
FORK_SERVER_PRELOAD = ("fedpar.parallel.init", "fedpar.simulations.agents", "fedpar.server.ranks.local",
                       "fedpar.parallel.fork_server_exit")


def rank_start_method(may_fork: bool = True) -> str:
    """How a launch from this process starts its ranks (or workers): "fork" where :func:`fork_safe` holds (and
    ``may_fork``); else, on Linux with no GPU visible, "forkserver": forked from one helper process that imported
    torch and fedpar once (multiprocessing starts it at the first child and keeps it while this process lives), so
    only the first child pays an interpreter's start and torch's import; else "spawn", as also in a process forked
    from one that had a fork server: multiprocessing's copy of the parent's server in the child checks on it with
    waitpid, which fails there (not the child's child: "No child processes")."""
    global _FORK_SERVER_OF
    if may_fork and fork_safe():
        return "fork"
    if sys.platform.startswith("linux") and not torch.cuda.is_available() and _FORK_SERVER_OF in (None, os.getpid()):
        _FORK_SERVER_OF = os.getpid()
        mp.get_context("forkserver").set_forkserver_preload(list(FORK_SERVER_PRELOAD))
        return "forkserver"
    return "spawn"


_FORK_SERVER_OF: int | None = None  # the process that asked for this process's fork server (a forked child: its parent)


def _start_replacement(rank: int, nproc: int, port: int, fn: Callable[..., Any], args: tuple,
                       env: dict[str, str], start_method: str):
    """A fresh process in lost rank ``rank``'s slot, told it replaces it (it asks rank 0 to take it back); started as
    the launch started its ranks (forked: the launcher still runs one thread, it only watches its ranks)."""
    process = mp.get_context(start_method).Process(target=_spawned_worker, name=f"fedpar-rank-{rank}",
                                                   args=(rank, nproc, port, fn, args, True, {**env, REPLACEMENT_ENV: "1"},
                                                         launcher_side(start_method)))
    with interrupts_held(start_method):
        process.start()
    return process


def _follow_rank_0(context, replace: Callable[[int], Any], budget: RestartBudget, rank_0_resumes: bool,
                   linger: float = 30.0) -> bool:
    """Wait for rank 0 to end, having ``replace`` start a fresh process for each other rank that dies meanwhile (a
    failure: a rank rank 0 stopped leaves with 0) while ``budget`` allows. True when rank 0 died by a signal, may
    resume (``rank_0_resumes``) and ``budget`` allows starting every rank again (the others are then stopped at
    once); else wait up to ``linger`` seconds for the others (killed after that) and raise rank 0's failure as
    torch's launcher raises it, whatever became of the others."""
    first, ranks = context.processes[0], context.processes  # the list stop_ranks and a second signal see
    while first.is_alive():
        first.join(0.5)
        raise_lost_stop()
        for rank in range(1, len(ranks)):
            if ranks[rank].exitcode not in (None, 0) and first.is_alive() and budget.allow(rank):
                ranks[rank] = replace(rank)
    if first.exitcode < 0 and rank_0_resumes and budget.allow(0, f"signal {signal.Signals(-first.exitcode).name}"):
        if len(ranks) > 1:
            stop_ranks(ranks[1:], 0.0)
        return True
    for process in ranks[1:]:
        process.join(timeout=linger)
        if process.is_alive():
            process.kill()
            process.join(timeout=1.0)
    context.sentinels = {s: i for s, i in context.sentinels.items() if i == 0}  # the others' ends are not failures
    context.join()
    return False


def stop_ranks(ranks: list, grace: float) -> None:
    """SIGTERM to rank 0 and up to ``grace`` seconds for it to leave (it may hold what the run must write: the
    coordinator's summary and checkpoint), then to the others; a rank still there a second later is killed."""
    first, rest = ranks[0], ranks[1:]
    if first.is_alive():
        first.terminate()
        first.join(grace)
    for process in rest:
        if process.is_alive():
            process.terminate()
    for process in ranks:
        process.join(timeout=1.0)
        if process.is_alive():
            process.kill()
            process.join(timeout=1.0)
