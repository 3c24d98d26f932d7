"""``fedpar simulate --flower-app DIR`` without ``--strategy``: the app's ServerApp runs unchanged on fedpar's
coordinator (server/flower_rounds.py, through the Grid of server/flower_grid.py) and worker processes host the
population, whose members answer the Messages with the app's ClientApp (simulations/client_app_population.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from fedpar.aggregation import build_strategy
from fedpar.security.admission import Admission
from fedpar.security.certs import temporary_cert_dir
from fedpar.security.tls import server_credentials, server_tls_files
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.flower_rounds import FlowerCoordinator
from fedpar.settings import composed
from fedpar.simulations.agents import WorkerConfig
from fedpar.simulations.config import WAITING_SEATS, SimulationConfig
from fedpar.simulations.population import PopulationSlice
from fedpar.simulations.run_outputs import EarlierRun, write_run_outputs
from fedpar.simulations.worker_processes import WorkerProcesses
from fedpar.task import TaskFailed
from fedpar.tasks.flower_app import FlowerApp

log = logging.getLogger("fedpar.simulate")
# Fixed, as a longer wait cannot help: every member joined before the ServerApp started; a lost worker ends the run
NODE_PATIENCE_SECONDS = 5.0


def flower_app_refusal(cfg: SimulationConfig) -> str | None:
    """One line saying which of ``cfg``'s settings a ServerApp-driven run cannot honour, and what to do; None when
    every one can be. Only the settings that --strategy would let fedpar apply are told to add it."""
    trains = [flag for on, flag in ((cfg.task is not None, "--task"), (cfg.client_batching, "--client-batching"))
              if on]
    if trains:  # refused with --strategy too (simulations/runner.py): the ClientApp trains whoever drives
        return (f"{', '.join(trains)}: the Flower App's ClientApp trains the clients, whether its ServerApp or "
                f"--strategy drives the rounds, so fedpar cannot apply {_it(trains)}; drop {_it(trains)}")
    asked = [(cfg.secure_aggregation, "--secure-aggregation"),
             (cfg.virtual_clock, "--clock virtual"), (cfg.aggregator_ranks > 1, "--aggregator-ranks"),
             (cfg.upload_compression.method != "none", "--compression"), (cfg.trace is not None, "--trace"),
             (cfg.drop_probability > 0, "--drop-probability"), (cfg.clients_per_round not in (None, cfg.clients),
                                                                "--clients-per-round"),
             (cfg.checkpoint_dir is not None, "--checkpoint-dir")]
    named = [flag for on, flag in asked if on]
    if not named:
        return None
    return (f"{', '.join(named)}: the Flower App's ServerApp decides sampling and aggregation, so fedpar cannot "
            f"apply {_it(named)}; drop {_it(named)}, or add --strategy NAME to let fedpar drive the app's ClientApp")


def _it(flags: list[str]) -> str:
    """'it' for one flag, 'them' for several."""
    return "it" if len(flags) == 1 else "them"


def run_flower_app(cfg: SimulationConfig, app: FlowerApp, run_config: str | None = None,
                   on_server: Callable[[CoordinatorServer], None] | None = None) -> dict:
    """Run ``app``'s ServerApp against ``cfg.clients`` members hosted by ``cfg.workers`` processes (``run_config``:
    the --run-config overrides, given to the workers, which load the app themselves); writes metrics.jsonl, the
    final arrays (global.safetensors, global.json) and summary.json (with the Result's metrics under "flower")
    under ``cfg.out``; returns the summary. ``on_server(server)`` sees the coordinator before it starts."""
    problem = flower_app_refusal(cfg)
    if problem:
        raise ValueError(problem)
    # the workers load the ClientApp: a broken one is said here, once, not as each worker's traceback
    app.check_client_app()
    started = time.monotonic()
    out = Path(cfg.out) if cfg.out else None
    earlier = workers = None
    if out:  # a Flower App run does not resume: an earlier run's files are set aside until this one ends
        out.mkdir(parents=True, exist_ok=True)
        earlier = EarlierRun(out)
    try:
        # started before the coordinator's set-up, forked while this process runs one thread
        workers = WorkerProcesses(max(1, min(cfg.workers, cfg.clients)), None, cfg.data_dir)
        summary = _serve_app(cfg, app, run_config, out, started, workers, on_server)
        if earlier is not None and earlier.settle():  # no round written: the earlier run's files are back
            summary["written"] = []
        return summary
    finally:
        if workers is not None:
            workers.close(wait=False)
        if earlier is not None:  # no round written (stopped or failed before one): nothing of it is lost
            earlier.settle()


def _serve_app(cfg: SimulationConfig, app: FlowerApp, run_config: str | None, out: Path | None, started: float,
               workers: WorkerProcesses, on_server: Callable[[CoordinatorServer], None] | None = None) -> dict:
    """:func:`run_flower_app`'s run on ``workers`` (each sent its slice once the coordinator listens)."""
    hosts = [f"host-{w}" for w in range(len(workers.procs))]
    certs = temporary_cert_dir(hosts) if cfg.tls else None
    coord_cfg = composed(
        CoordinatorConfig, cfg, clients_per_round=cfg.clients, min_available=cfg.clients, heartbeat_seconds=2.0,
        liveness_timeout_seconds=30.0, wait_for_agents_seconds=300.0, accept_populations=True,
        metrics_path=out / "metrics.jsonl" if out else None, flower_run_config=app.run_config,
        max_agents=max(CoordinatorConfig.max_agents, cfg.clients + 64))
    from fedpar.server.flower_grid import server_app_main

    coordinator = FlowerCoordinator(coord_cfg, build_strategy("fedavg"),
                                    server_app_main(app.server_app, app.run_config, NODE_PATIENCE_SECONDS),
                                    admission=Admission(require_certificate=cfg.tls))
    server = CoordinatorServer(coordinator, credentials=server_credentials(server_tls_files(certs.name))
                               if certs else None)
    interrupted = False
    try:
        if on_server is not None:
            on_server(server)
        server.start()
        slices = [PopulationSlice.of(host, np.arange(w, cfg.clients, len(hosts)), None,
                                     np.zeros(cfg.clients, np.float32)) for w, host in enumerate(hosts)]
        for send, population in zip(workers.sends, slices):
            send.send(composed(WorkerConfig, cfg, server=server.address, population=population,
                               flower_app=str(app.directory), run_config=run_config, answers_messages=True,
                               seats=cfg.seats or WAITING_SEATS, certs_dir=certs.name if certs else None,
                               log_level=logging.getLogger("fedpar").getEffectiveLevel()))
            send.close()
        while not server.wait(0.5):
            dead = [p for p in workers.procs if not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                raise RuntimeError(f"worker process {dead[0].name} died with exit code {dead[0].exitcode}")
        if server.error is not None:
            raise RuntimeError(f"{server.error}" if isinstance(server.error, TaskFailed) else
                               f"the ServerApp failed: {type(server.error).__name__}: {server.error}")
        for p in workers.procs:
            p.join(timeout=30)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (parallel/stopping.py): what completed is still written
        interrupted = True
    finally:
        server.stop(grace=0.5 if interrupted else 1.0)
        if interrupted:  # counted once stopped, as the summary and fedpar simulate's last line count them
            log.warning("interrupted: stopping after %d Message exchanges (a ServerApp's round is usually two: train "
                        "and evaluate)", coordinator.metrics.summary.rounds)
        workers.close(wait=False)  # a run that ended normally has joined them already
        if certs is not None:
            certs.cleanup()
    extra = {"wall_seconds": time.monotonic() - started, "flower": coordinator.flower_summary,
             "config": asdict(cfg), **({"interrupted": True} if interrupted else {})}
    if not out:
        return {**coordinator.metrics.summary.result(), **extra, "written": []}
    outputs = write_run_outputs(out, coordinator, {"flower_app": str(app.directory)}, extra,
                                title=f"Flower App {app.directory.name}, {cfg.clients} clients",
                                plots=None if cfg.plot else False)
    return {**outputs.summary, "written": outputs.written}
