"""A whole federated run on one machine: a real coordinator and worker processes hosting the population on
loopback gRPC (simulations/population.py: only the clients sampled in a round get a model and their data)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fedpar.aggregation import build_strategy
from fedpar.aggregation.compatibility import check_composition, options_privacy
from fedpar.aggregation.registry import strategy_name
from fedpar.cli.serve_service import RunService, json_ready
from fedpar.cli.task_options import REPLACED_BY_TASK
from fedpar.cli.user_errors import UserError, describe
from fedpar.client.trainer import PRECISIONS
from fedpar.datasets import load_dataset
from fedpar.datasets.registry import full_dataset_name
from fedpar.parallel.device import check_device_layout, device_kind, parse_device, resolve_device, visible_gpus
from fedpar.models.weights import weight_specs
from fedpar.security.admission import Admission
from fedpar.security.certs import temporary_cert_dir
from fedpar.security.sslcontext import server_ssl_context
from fedpar.security.tls import server_credentials, server_tls_files
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.checkpoint import CheckpointError, has_checkpoint, saved_strategy, strategy_refusal
from fedpar.server.config import CoordinatorConfig
from fedpar.server.run_store import RunStore
from fedpar.simulations.agents import TASK_FAILED_EXIT, WorkerConfig
from fedpar.simulations.client_batching import batched_seats, batching_refusal_of, client_batching_route
from fedpar.simulations.config import WAITING_SEATS, SimulationConfig
from fedpar.server.ranks.local import IngestRankSpec, IngestRanks
from fedpar.simulations.population import PopulationSlice, step_delays
from fedpar.simulations.resume import RunRecord, check_resume
from fedpar.simulations.run_outputs import RunOutputs, earlier_run_in, import_plots_ahead, write_run_outputs
from fedpar.simulations.traces import VIRTUAL_DAY, Traces, traces_for
from fedpar.simulations.worker_processes import WorkerProcesses, check_population_fits, start_workers
from fedpar.settings import composed
from fedpar.task import Partition
from fedpar.tasks.flower_app import FlowerApp, load_flower_app
from fedpar.tasks.reference import load_task
from fedpar.datasets.clientdata import label_counts, label_skew, resolve_partition
from fedpar.datasets.members import MemberSource, member_source

log = logging.getLogger("fedpar.simulate")
LABEL_PLOT_CLIENTS = 100  # clients shown in OUT/labels.png
LABEL_SKEW_CLIENTS = 2_000  # clients the summary's label skew is measured on (the first ones: all, below that)


class ProcessLost(RuntimeError):
    """A process of the simulation (a worker, an aggregator rank) died; the message names it, ``written`` the files
    of --out that hold the rounds completed before it (the model of the last one among them)."""

    written: tuple[str, ...] = ()


class TaskStopped(ProcessLost):
    """A worker process stopped because the task's own code failed, having said what failed in one line."""


def _step_delays(cfg: SimulationConfig, traces: Traces | None = None) -> np.ndarray:
    """Seconds each client adds per local step: its trace's, else ``slow_step_delay`` for the slow share."""
    return step_delays(cfg.clients, cfg.slow_fraction, cfg.slow_step_delay, cfg.seed, traces)


def _population_slices(cfg: SimulationConfig, sizes: np.ndarray | None, hosts: int) -> list[PopulationSlice]:
    """The population dealt round-robin over ``hosts`` worker processes (with its traces, if any; ``sizes``: each
    client's examples, None for a task, whose hosts count each member's examples in its data)."""
    traces = traces_for(cfg.trace, cfg.clients, cfg.seed)
    delays = _step_delays(cfg, traces)
    return [PopulationSlice.of(f"host-{h}", np.arange(h, cfg.clients, hosts), sizes, delays, cfg.drop_probability,
                               traces) for h in range(hosts)]


def check_seats(cfg: SimulationConfig) -> None:
    """ValueError unless every worker process has a seat to train its sampled clients on."""
    if cfg.seats is not None and cfg.seats < 1:
        raise ValueError("--seats must be >= 1")


def seats_of(cfg: SimulationConfig, slices: list[PopulationSlice], model_bytes: int, replies: bool = False) -> int:
    """A worker's seats: --seats, else 1 where no seat would wait, else WAITING_SEATS. A seat waits for a member's
    update that goes up on its own (larger than a chunk, a secure round's masked vector, a Flower App member's reply:
    ``replies``), for a top-k verdict, while a slow device sleeps (the real clock), and may wait for a user's task to
    read a member's data (--task); where none does, more seats only wake more threads to share one core's turn (the
    10-of-100 digits round 0.90x with one seat against four, 8 alternated runs)."""
    if cfg.seats is not None:
        return cfg.seats
    sleeps = not cfg.virtual_clock and any(s.step_delays.any() for s in slices)
    waits = sleeps or replies or cfg.secure_aggregation or cfg.upload_compression.method == "topk" \
        or cfg.task is not None or model_bytes > CoordinatorConfig.max_chunk_bytes
    return WAITING_SEATS if waits else 1


def check_traces(cfg: SimulationConfig) -> None:
    """ValueError for a trace that cannot be used (read before anything starts)."""
    if cfg.trace_day_seconds <= 0:
        raise ValueError("--trace-day-seconds must be > 0")
    traces_for(cfg.trace, cfg.clients, cfg.seed)


def check_client_speeds(cfg: SimulationConfig) -> None:
    """ValueError, one line, for a setting of the clients' speed or of a trace's day that the run would ignore (a
    user who set it believes it applies)."""
    if cfg.slow_fraction > 0 and cfg.trace:  # simulations/population.py step_delays: the trace's own, when given
        raise ValueError("--slow-fraction: the trace (--trace) gives each client its own speed; drop one of them")
    if cfg.slow_fraction > 0 and cfg.flower_app and not cfg.virtual_clock:  # (that clock counts its steps' time)
        raise ValueError("--slow-fraction: a Flower App's ClientApp trains at its own pace, which fedpar cannot slow "
                         "on the real clock; drop it, or use --clock virtual (a slow client then costs simulated time)")
    if cfg.virtual_clock and cfg.trace_day_seconds != SimulationConfig.trace_day_seconds:
        raise ValueError(VIRTUAL_DAY)


def check_settings(cfg: SimulationConfig) -> list[str]:
    """ValueError, one line, for settings no simulation can run: checked before any process starts; else the lines
    to say of a resume (:func:`check_resume`)."""
    check_device_layout(cfg.device)
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {cfg.precision!r}")
    check_seats(cfg)
    check_population_fits(cfg)  # before the traces: a trillion clients' would fill the memory first
    check_traces(cfg)
    check_client_speeds(cfg)
    check_composition(cfg.strategy, cfg.secure_aggregation, cfg.upload_compression.method,
                      privacy=options_privacy(cfg.strategy_options))
    check_resumed_strategy(cfg)  # before check_resume says what a resume changes: a refused one says only why
    return check_resume(cfg)


def check_resumed_strategy(cfg: SimulationConfig) -> None:
    """CheckpointError when ``cfg`` would resume a checkpoint made with another strategy: said now, from the
    checkpoint's state.json, not by the coordinator once the data is loaded."""
    saved_by = saved_strategy(cfg.checkpoint_dir)
    if saved_by is None or not cfg.strategy.strip():
        return
    name = strategy_name(cfg.strategy)  # a Flower strategy's is its reference, as given (the coordinator's too)
    if saved_by != name:
        raise CheckpointError(strategy_refusal(cfg.checkpoint_dir, saved_by, name))


def _make_out(out: Path) -> None:
    """Make the --out folder; UserError in one line when it cannot be made (a path under /proc, no permission)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot make the folder: {describe(exc)}") from None


def worker_devices(spec: str, workers: int, gpus: int | None = None) -> list[str]:
    """The device of each worker process: one GPU named by ``spec``, or workers dealt round-robin over
    the ``gpus`` visible GPUs (``cuda``/``auto`` on a GPU machine; default: this machine's), or the CPU."""
    gpus = visible_gpus() if gpus is None else gpus
    if device_kind(spec, gpus) == "cpu":
        return ["cpu"] * workers
    if ":" in parse_device(spec):
        return [parse_device(spec)] * workers
    return [f"cuda:{w % gpus}" for w in range(workers)]


def run_simulation(cfg: SimulationConfig, on_round: Callable[[dict], None] | None = None,
                   on_server: Callable[[object], None] | None = None,
                   on_progress: Callable[[object], None] | None = None,
                   on_stage: Callable[[str], None] | None = None, store: RunStore | None = None,
                   workers: WorkerProcesses | None = None) -> dict:
    """Run the federation to the end (or a Ctrl-C: then the summary says ``interrupted``); writes metrics.jsonl,
    the final model (global.safetensors, global.json), summary.json, accuracy.png and loss.png (not after a Ctrl-C)
    under ``cfg.out`` (see :func:`write_run_outputs`), and returns the summary with ``written``: the names of the
    files written.
    ``on_server(server)`` sees the coordinator before it starts; ``on_progress(coordinator)`` is called twice a
    second while it runs (clients joined, the open round); ``on_stage(what)`` as each set-up step starts (loading the
    data, indexing the clients' shares). The run is kept in ``store`` (default: one in memory), as a service keeps its
    runs, and driven by the same code (:meth:`RunService.execute`). ``workers``: the worker processes, started
    already (:func:`start_workers`; `fedpar simulate` starts them before the coordinator is set up); they are ended
    here."""
    started = workers.started if workers else time.monotonic()  # the run's set-up began with its workers
    cfg, notes = cfg.settled()  # `fedpar simulate` has settled them already, and said so
    for note in notes:
        log.warning(note)
    cfg = replace(cfg, dataset=full_dataset_name(cfg.dataset, cfg.clients))  # every process builds the same data
    for line in check_settings(cfg):  # `fedpar simulate` has said them on stderr
        log.info(line)
    strategy = build_strategy(cfg.strategy, **cfg.strategy_options)
    strategy.check_ranks(cfg.aggregator_ranks)
    flower_app = _flower_app(cfg)
    task = load_task(cfg.task, cfg.task_options) if cfg.task else None  # a task's mistakes, before anything starts
    out = Path(cfg.out) if cfg.out else None
    earlier = None
    if out:
        _make_out(out)
        earlier = earlier_run_in(out, has_checkpoint(cfg.checkpoint_dir))
    record = RunRecord(cfg)  # kept once the coordinator resumed (or started afresh): SimulationService.listening
    # The worker processes start as early as they can (forked before this process runs a second thread): their data
    # loading overlaps the coordinator's.
    workers = workers or start_workers(cfg)
    if cfg.out and cfg.plot:
        import_plots_ahead()  # while the workers start
    interrupted = True  # until _run returns: then the workers are given time to finish by themselves
    threads = torch.get_num_threads()
    if device_kind(cfg.device) == "cpu":
        # the workers train on the cores: the coordinator folds and evaluates on one thread, as torch's default of
        # one per core spin-waits on the cores the workers need (benchmarks/population_bench.py --steady)
        torch.set_num_threads(1)
    def round_written(row: dict) -> None:
        record.update_now_and_then(time.monotonic() - started)
        if on_round is not None:
            on_round(row)

    try:
        summary = _run(cfg, strategy, task, round_written, started, out, workers.procs, workers.sends, on_server,
                       on_progress, flower_app, on_stage or (lambda what: None), store, record)
        interrupted = summary.get("interrupted", False)
        if earlier is not None and earlier.settle():  # stopped before a round: the earlier run's files are back
            summary["written"] = []
        return summary
    finally:
        if earlier is not None:  # no round written (refused, stopped or failed before one): nothing of it is lost
            earlier.settle()
        torch.set_num_threads(threads)
        with contextlib.suppress(OSError):  # however it ended, a resume counts this process's seconds too (a full
            record.update(time.monotonic() - started)  # disk: what stopped the run is what to say)
        workers.close(wait=not interrupted)


def _flower_app(cfg: SimulationConfig) -> FlowerApp | None:
    """The ``--flower-app`` project, loaded (its ClientApp imported: its mistakes show before anything starts), or
    None; ValueError for settings that cannot go with it."""
    if not cfg.flower_app:
        if cfg.run_config:
            raise ValueError("--run-config needs --flower-app")
        return None
    if cfg.task:
        raise ValueError("--flower-app and --task both say what the clients train; give one")
    if cfg.client_batching:
        raise ValueError("--client-batching stacks fedpar's own local loop; a Flower App trains in its ClientApp: "
                         "drop --client-batching")
    app = load_flower_app(cfg.flower_app, cfg.run_config)
    app.check_client_app()
    return app


def _run(cfg: SimulationConfig, strategy, task, on_round, started: float, out: Path | None, procs, pipes,
         on_server=None, on_progress=None, flower_app: FlowerApp | None = None,
         on_stage: Callable[[str], None] = lambda what: None, store: RunStore | None = None,
         record: RunRecord | None = None) -> dict:
    """The coordinator side of :func:`run_simulation`, once the worker processes are starting."""
    from fedpar.cli.serve import ServePlan  # serve's command module: not loaded by every spawned worker
    from fedpar.cli.tlsopts import ServerSecurity

    if flower_app is not None:  # the ClientApp loads its own data; fedpar's strategy starts from the app's arrays
        splits, members = None, None
        assembly = CoordinatorAssembly.for_flower_app(flower_app, cfg.seed)
    elif task is not None:
        splits, members = None, None  # the task's client_data gives each client its share
        assembly = CoordinatorAssembly.for_task(task, cfg.seed, resolve_device(cfg.device))
    else:
        on_stage(f"loading {cfg.dataset}")
        splits = load_dataset(cfg.dataset, cfg.data_dir)
        on_stage(f"indexing the data of {cfg.clients:,} clients ({resolve_partition(cfg.partition, splits)})")
        members = member_source(splits, cfg.partition, cfg.clients, cfg.seed, cfg.examples_per_client)
        assembly = CoordinatorAssembly.for_data(cfg.model, splits, cfg.seed, resolve_device(cfg.device))
        assembly.description["dataset"] = cfg.dataset
    k = cfg.clients_per_round or cfg.clients
    devices = worker_devices(cfg.device, len(pipes))
    first_member = functools.partial(task.client_data, Partition(0, cfg.clients, seed=cfg.seed)) if task else None
    batching = flower_app is None and client_batching_route(  # a ClientApp trains itself (on: refused above)
        cfg.client_batching, lambda: batching_refusal_of(assembly.model, task, cfg.precision,
                                                         first_member() if first_member else None),
        devices[0], k / len(pipes), assembly.model, k >= cfg.clients)
    slices = _population_slices(cfg, None if members is None else members.sizes, len(pipes))
    model_bytes = sum(w.nbytes for w in assembly.weights)  # an update's size (a Flower App has no torch model here)
    layout = weight_specs(assembly.model) if task is not None else None  # each worker's task must make it too
    seats = [seats_of(cfg, slices, model_bytes, replies=flower_app is not None)] * len(slices)
    if batching:  # a worker's members of a round train as one stack: a seat each
        seats = [batched_seats(seats[0], len(s), k, model_bytes) for s in slices]
    log.info("seats per worker process: %s%s", ", ".join(map(str, seats)), "" if cfg.seats is None else " (--seats)")
    # The sections the simulation shares with the coordinator (rounds, seed, local training, aggregator ranks,
    # secure aggregation, clock, target accuracy) pass as they are; the rest is what a simulation on one machine
    # fills in.
    coord_cfg = composed(
        CoordinatorConfig, cfg, clients_per_round=k, upload_compression=cfg.upload_compression,
        # The virtual clock waits for K online (moving on through the traces' night); the real clock waits for every
        # client to join, and a round then samples those online (server/members.py: the offline are not waited for).
        min_available=min(cfg.clients, k) if cfg.trace and cfg.virtual_clock else cfg.clients,
        joined_count_as_available=bool(cfg.trace) and not cfg.virtual_clock,
        heartbeat_seconds=2.0, liveness_timeout_seconds=30.0, wait_for_agents_seconds=300.0,
        metrics_path=out / "metrics.jsonl" if out else None, checkpoint_dir=cfg.checkpoint_dir, accept_populations=True,
        # every seat of every host may be uploading at once (a staging slot holds one model copy)
        max_concurrent_uploads=max(CoordinatorConfig.max_concurrent_uploads, sum(seats)),
        max_queued_uploads=max(CoordinatorConfig.max_queued_uploads, sum(seats)),
        max_agents=max(CoordinatorConfig.max_agents, cfg.clients + 64))
    # Under mutual TLS each host proves its own identity, and speaks for its members (who have no certificates).
    certs = temporary_cert_dir([s.host_id for s in slices]) if cfg.tls else None
    ranks = None
    if cfg.aggregator_ranks > 1:
        ranks = IngestRanks(cfg.aggregator_ranks, composed(IngestRankSpec, cfg, config=coord_cfg,
                                                            certs_dir=certs.name if certs else None,
                                                            log_level=logging.getLogger("fedpar").getEffectiveLevel()))
    security = ServerSecurity(
        credentials=server_credentials(server_tls_files(certs.name)) if certs else None,
        admission=Admission(require_certificate=cfg.tls),
        description="mutual TLS (the simulation's own certificates)" if certs else "plaintext", client_hint="",
        data_tls=server_ssl_context(server_tls_files(certs.name)) if certs else None)

    def worker_configs(address: str) -> list[WorkerConfig]:
        return [composed(WorkerConfig, cfg, server=address, population=slices[w], device=devices[w], seats=seats[w],
                         client_batching=batching, certs_dir=certs.name if certs else None,
                         log_level=logging.getLogger("fedpar").getEffectiveLevel(), model_layout=layout)
                for w in range(len(pipes))]

    own_store = store is None
    store = RunStore(":memory:") if own_store else store
    service = SimulationService(cfg, store, started, procs, pipes, worker_configs, on_round=on_round,
                                on_server=on_server, on_progress=on_progress, members=members, splits=splits,
                                batching=batching, record=record or RunRecord(cfg))
    run = store.get(store.submit("simulate", json_ready(asdict(cfg))))
    stopped_by: KeyboardInterrupt | None = None  # SIGINT or SIGTERM (parallel/stopping.py)
    try:
        end = service.execute(run, ServePlan(coord_cfg, security, assembly, strategy),
                              ranks.leader if ranks else None)
        stopped_by = end.stopped_by
        if stopped_by is None and end.outputs is not None and service.lost is None:  # else the caller stops them
            for p in procs:
                p.join(timeout=30)
    finally:
        if ranks is not None:
            ranks.close(wait=stopped_by is None)
        if certs is not None:
            certs.cleanup()
        if own_store:
            store.close()
    if end.outputs is None:  # the coordinator could not be built or started
        raise ValueError(end.reason)
    service.raise_lost(end.outputs.written)
    return {**end.outputs.summary, "written": end.outputs.written}


class SimulationService(RunService):
    """A RunService whose one run is a simulation's: the worker processes get their slices of the population once
    the coordinator listens, a worker that dies ends the run (ProcessLost), and the summary says how it was set up."""

    keeps_members = False  # the hosts hear that training is over, and stop
    samples_by_task = False  # every host's members are sampled

    def __init__(self, cfg: SimulationConfig, store: RunStore, started: float, procs, pipes,
                 worker_configs: Callable[[str], list], *, on_round, on_server, on_progress, members, splits,
                 batching: bool, record: RunRecord):
        settings = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
        super().__init__(argparse.Namespace(**settings, state=None, host="127.0.0.1"), store, 0, lambda args: None)
        self.cfg, self.started, self.procs, self.pipes = cfg, started, procs, pipes
        self.worker_configs, self.on_round, self.on_server, self.on_progress = (worker_configs, on_round, on_server,
                                                                                on_progress)
        self.members, self.splits, self.batching = members, splits, batching
        self.record = record  # the --checkpoint-dir's run.json, kept once the coordinator resumed
        self.earlier = record.earlier  # what the processes before this one ran of the run it resumes
        self.lost: ProcessLost | None = None  # a worker died: the rounds before are written, then it is raised

    def settle(self, run):
        """``run`` as it is: its settings are the simulation's, all of them, from the start."""
        return run

    def options_of(self, run) -> argparse.Namespace:
        """The simulation's settings."""
        return self.args

    def tensorboard_dir(self, run) -> str | None:
        """None: `fedpar simulate` writes TensorBoard events from its own round callbacks."""
        return None

    def round_callbacks(self, plan, ranks) -> list[Callable[[dict], None]]:
        """``on_round``."""
        return [self.on_round] if self.on_round else []

    def watch(self, server, run) -> None:
        """``on_server`` sees the coordinator before it starts."""
        if self.on_server is not None:
            self.on_server(server)

    def listening(self, server, plan) -> None:
        """The checkpoint resumed (or none): its run.json is kept; then each worker process gets its slice of the
        population and where to dial."""
        self.record.keep(time.monotonic() - self.started)
        super().listening(server, plan)
        for send, config in zip(self.pipes, self.worker_configs(server.address)):
            send.send(config)
            send.close()

    def waiting(self, server) -> None:
        """``on_progress``, and ProcessLost when a worker process died."""
        if self.on_progress is not None:
            self.on_progress(server.coordinator)
        dead = [p for p in self.procs if not p.is_alive() and p.exitcode not in (0, None)]
        if dead and dead[0].exitcode == TASK_FAILED_EXIT:
            raise TaskStopped(f"worker process {dead[0].name} stopped: the task's own code failed")
        if dead:
            raise ProcessLost(f"worker process {dead[0].name} died with exit code {dead[0].exitcode}")

    def linger(self, server) -> None:
        """The coordinator answers until every worker process has heard that training is over and left (up to 30 s):
        a host whose members were away at the end polls later than the others, and must not be left retrying a
        coordinator that is gone."""
        end = time.monotonic() + 30.0
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))

    def round_error(self, exc: Exception, config) -> str:
        """Re-raised: the simulation ends with it; a lost worker process once the outputs of the rounds completed
        before it are written (:meth:`raise_lost`)."""
        if not isinstance(exc, ProcessLost):
            raise exc
        self.lost = exc
        return str(exc)

    def raise_lost(self, written: list[str]) -> None:
        """The lost worker's ProcessLost, if one was, told the files written (``written``)."""
        if self.lost is not None:
            self.lost.written = tuple(written)
            raise self.lost

    def outputs(self, out: Path | None, server, plan, run, args, extra: dict, plots: bool = True) -> RunOutputs:
        """The summary with how the simulation was set up, and, with --out, the files it leaves there (its plots
        with ``plots``)."""
        cfg, coordinator, members, splits = self.cfg, server.coordinator, self.members, self.splits
        if extra["interrupted"]:  # Ctrl-C or SIGTERM: what completed is still written (the CLI says it: info here)
            log.info("interrupted: stopping after %d completed rounds", coordinator.metrics.summary.rounds)
        first = coordinator.metrics.first
        first_start = coordinator.started_at + first["wall_seconds"] - first["round_seconds"] if first else None
        extra = {"wall_seconds": self.earlier + time.monotonic() - self.started,  # a resumed run's, all of it
                 "earlier_processes_seconds": self.earlier,
                 "startup_seconds": None if first_start is None else first_start - self.started,
                 "label_skew": label_skew(*_member_labels(members, LABEL_SKEW_CLIENTS), splits.num_classes)
                 if splits else None,
                 # a task brings its own model and data: the zoo's defaults beside it would mislead
                 "config": json_ready({k: v for k, v in asdict(cfg).items()
                                       if not ((cfg.task or cfg.flower_app) and k in REPLACED_BY_TASK)}),
                 "client_batching": self.batching,  # the route --client-batching (auto by default) took
                 **({"interrupted": True} if extra["interrupted"] else {})}
        if out is None:
            return RunOutputs({**coordinator.metrics.summary.result(), **extra})
        what = cfg.flower_app or cfg.task or f"{cfg.dataset} / {cfg.model}"
        more_plots = {} if splits is None else {"labels.png": functools.partial(  # a task's labels are its own
            _plot_labels, _member_labels(members, LABEL_PLOT_CLIENTS), splits.num_classes,
            f"{cfg.partition}: labels of the first {min(cfg.clients, LABEL_PLOT_CLIENTS)} clients")}
        return write_run_outputs(out, coordinator, plan.assembly.description, extra,
                                 title=f"{what} / {cfg.partition}, {cfg.clients} clients", more_plots=more_plots,
                                 plots=plots)

    def _say(self, run, line: str) -> None:
        """Into the run's log only: the terminal has the round table."""
        self.store.log(run.id, line)


def _member_labels(members: MemberSource, count: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The labels of the first ``count`` members, as (each one's indices into the labels, the labels)."""
    labels = [members.labels(k) for k in range(min(count, len(members.sizes)))]
    ends = np.cumsum([len(lab) for lab in labels])
    return np.split(np.arange(ends[-1] if len(ends) else 0), ends[:-1]), \
        np.concatenate(labels) if labels else np.zeros(0, np.int64)


def _plot_labels(labels: tuple[list[np.ndarray], np.ndarray], num_classes: int, title: str, path: Path) -> None:
    """OUT/labels.png: the labels each of the clients holds (matplotlib is imported only to draw it)."""
    from fedpar.simulations.plots import plot_label_counts

    plot_label_counts(label_counts(*labels, num_classes), path, title)
