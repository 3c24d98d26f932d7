"""Aggregator ranks on this machine, for `fedpar simulate --aggregator-ranks N`: the calling process is rank 0 (its
coordinator), and N - 1 spawned processes are the other ranks, each an IngestRank behind its own gRPC server. A rank
that rank 0 declares lost (it died or hangs) is killed here, so a hung one cannot come back into a group that went on
without it, and a fresh process is started in its slot, which rank 0 takes back when the next round opens; at most
parallel/restarts.py's RESTARTS_PER_HOUR times a slot in any hour, then the coordinator goes on without it."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import secrets
import time
from dataclasses import dataclass

import torch

from fedpar.aggregation import build_strategy
from fedpar.datasets import load_dataset
from fedpar.datasets.settings import DataFiles, DataSource
from fedpar.parallel.child_logs import LauncherSide, launcher_side, log_like_parent, own_standard_streams
from fedpar.parallel.restarts import RestartBudget
from fedpar.parallel.init import exit_rank_process, join_gloo_group, rank_start_method, shutdown_distributed
from fedpar.parallel.stopping import die_with_parent, dump_stacks_on_signal, interrupts_held, parent_stops_this
from fedpar.ports import ReservedPort
from fedpar.security.admission import Admission
from fedpar.security.sslcontext import server_ssl_context
from fedpar.security.tls import server_credentials, server_tls_files
from fedpar.sections import Seeded
from fedpar.server.app import CoordinatorServer
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.config import CoordinatorConfig, StrategyChoice
from fedpar.server.ranks.group import RankGroup
from fedpar.server.ranks.ingest import IngestRank
from fedpar.server.ranks.leader import RankLeader
from fedpar.task import FlowerAppReference, TaskReference
from fedpar.tasks.flower_app import load_flower_app
from fedpar.tasks.reference import load_task


STOPPED_PEER_SECONDS = 3.0  # how long a rank whose group failed waits for rank 0's stop before raising its failure
START_SECONDS = 60.0  # the longest wait for the spawned ranks to join at start-up (they import torch first)


def _join(rank: int, world: int, port: int, spec: "IngestRankSpec") -> None:
    """Join the group; its collectives time out after --aggregator-timeout once it re-forms, the start-up may take
    longer."""
    join_gloo_group(rank, world, port, max(spec.config.aggregator_timeout_seconds, START_SECONDS))


# Sections are listed last first: a dataclass takes its bases' fields from the last base on.
@dataclass(kw_only=True)
class IngestRankSpec(FlowerAppReference, TaskReference, StrategyChoice, Seeded, DataFiles, DataSource):
    """What a spawned rank builds: the coordinator's settings, model (the zoo's for ``model``/``dataset``, or
    ``task`` made with ``task_options``), strategy, and the TLS certificates if any."""

    config: CoordinatorConfig
    certs_dir: str | None = None
    log_level: int = logging.WARNING  # of the rank's fedpar loggers: the parent's (simulate --log-level)


def _assembly(spec: IngestRankSpec) -> CoordinatorAssembly:
    """The rank's model: its weight names and first weights, with no central evaluation (a task's client and test
    data are not asked for)."""
    if spec.flower_app:
        return CoordinatorAssembly.for_flower_app(load_flower_app(spec.flower_app, spec.run_config), spec.seed)
    if spec.task:  # checked by rank 0 before the ranks start (its optimizer check alone costs 1.2 s: torch._dynamo)
        return CoordinatorAssembly.for_task(load_task(spec.task, spec.task_options, check=False), spec.seed, None)
    return CoordinatorAssembly.for_data(spec.model, load_dataset(spec.dataset, spec.data_dir), spec.seed, None)


def _rank_main(rank: int, world: int, port: int, namespace: str, spec: IngestRankSpec, replacing: bool,
               launcher: LauncherSide | None = None) -> None:
    """A started process: join the group (or, ``replacing`` a lost rank, ask rank 0 to take it back), then serve as
    aggregator rank ``rank`` until rank 0 stops (or dies); a fork server's child takes the ``launcher``'s streams and
    environment first."""
    parent_stops_this()
    own_standard_streams(launcher)
    die_with_parent()
    dump_stacks_on_signal()
    log_like_parent(spec.log_level)
    torch.set_num_threads(1)
    try:
        _serve_rank(rank, world, port, namespace, spec, replacing)
    except Exception:
        # rank 0 left as it stopped (a Ctrl-C as the ranks started): the group failed here, and rank 0's SIGTERM (or
        # its death's) ends this process silently within this wait; a failure of this rank's own is raised after it
        time.sleep(STOPPED_PEER_SECONDS)
        raise
    exit_rank_process(0)


def _serve_rank(rank: int, world: int, port: int, namespace: str, spec: IngestRankSpec, replacing: bool) -> None:
    """Join the group (or ask rank 0 to take this rank back), then serve as aggregator rank ``rank`` until rank 0
    stops."""
    timeout = spec.config.aggregator_timeout_seconds
    if replacing:
        group = RankGroup.replacement(rank, world, "127.0.0.1", port, namespace, timeout)
    else:
        _join(rank, world, port, spec)
        group = RankGroup(timeout, namespace)
    assembly = _assembly(spec)
    strategy = build_strategy(spec.strategy, **spec.strategy_options)
    files = server_tls_files(spec.certs_dir) if spec.certs_dir else None
    ingest = IngestRank(spec.config, assembly.names, assembly.weights, strategy, group,
                        admission=Admission(require_certificate=files is not None), control_tls=files)
    server = CoordinatorServer(ingest, credentials=server_credentials(files) if files else None,
                               data_tls=server_ssl_context(files) if files else None)
    try:
        server.serve_to_end()
    finally:
        shutdown_distributed()


class IngestRanks:
    """Ranks 1..N-1 in spawned processes, and this process joined as rank 0; :attr:`leader` goes to the coordinator."""

    def __init__(self, world: int, spec: IngestRankSpec):
        reserved = ReservedPort()  # rank 0's store binds it below: until then no other process can take it
        self.port = reserved.port
        self.namespace = f"fedpar/ranks/{secrets.token_hex(4)}"  # this run's keys in the rendezvous store
        rank_config = dataclasses.replace(spec.config, metrics_path=None, checkpoint_dir=None)
        self.spec = dataclasses.replace(spec, config=rank_config)
        self.world = world
        self.restarts = RestartBudget()
        # never forked: this process runs the coordinator's threads (a fork server's copies, else spawned)
        self.start_method = rank_start_method(may_fork=False)
        self.procs = [self._process(r, replacing=False) for r in range(1, world)]
        with reserved:
            with interrupts_held(self.start_method):  # rank 0 stops them
                for p in self.procs:
                    p.start()
            _join(0, world, self.port, self.spec)
        self.leader = RankLeader(RankGroup(self.spec.config.aggregator_timeout_seconds, self.namespace),
                                 tls=server_tls_files(spec.certs_dir) if spec.certs_dir else None, on_lost=self.end,
                                 ended=lambda rank: self.procs[rank - 1].exitcode is not None)

    def _process(self, rank: int, replacing: bool) -> mp.Process:
        return mp.get_context(self.start_method).Process(
            target=_rank_main, args=(rank, self.world, self.port, self.namespace, self.spec, replacing,
                                     launcher_side(self.start_method)),
            name=f"fedpar-rank-{rank}", daemon=True)

    def end(self, ranks: list[int]) -> None:
        """Kill the processes of ``ranks`` (declared lost: dead already, or hung) and start a replacement in each
        slot while its restart budget allows (parallel/restarts.py)."""
        for r in ranks:
            if self.procs[r - 1].is_alive():
                self.procs[r - 1].kill()
            self.procs[r - 1].join(timeout=1.0)
            if not self.restarts.allow(r):
                continue
            self.procs[r - 1] = self._process(r, replacing=True)
            with interrupts_held(self.start_method):
                self.procs[r - 1].start()

    def close(self, wait: bool = True) -> None:
        """Wait for the ranks to leave (they stop when rank 0 says the rounds are done), or without ``wait`` (the run
        was stopped early) stop them now; then leave the group."""
        for p in self.procs:
            p.join(timeout=30 if wait else 0)
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():  # hung (a stopped process takes no SIGTERM): this process's exit would wait for it
                p.kill()
                p.join(timeout=5)
        shutdown_distributed()
