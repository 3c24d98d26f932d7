"""``fedpar serve --flower-app DIR``: a Flower App's ServerApp runs unchanged on the coordinator (its Grid's
messages travel as the coordinator's rounds: server/flower_rounds.py), for agents started with
``fedpar client --flower-app DIR``, under the coordinator's TLS and admission (mutual TLS with ``fedpar certs``)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fedpar.cli.config import ignored_given
from fedpar.cli.declared import from_args
from fedpar.cli.observability import Observers
from fedpar.cli.privacy import privacy_on
from fedpar.cli.serve_service import until_told
from fedpar.cli.tlsopts import server_security
from fedpar.cli.user_errors import hold_output_folder, run_exit_code
from fedpar.parallel.stopping import signal_name
from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.codec import grpc_target
from fedpar.wording import counted
from fedpar.server.config import CoordinatorConfig
from fedpar.tasks.flower_app import ROUNDS_HINT

if TYPE_CHECKING:
    from fedpar.simulations.run_outputs import EarlierRun


def server_app_refusal(config: CoordinatorConfig, args: argparse.Namespace) -> str | None:
    """One line naming the settings a ServerApp-driven coordinator cannot honour, and what to do; None if none (a
    --config file's rounds, which the app's ServerApp leaves unused, is said in a note: cli/config.py
    ignored_given)."""
    typed_rounds = bool(ignored_given(args, {"rounds": "the Flower App's ServerApp decides its rounds"}))
    asked = [(config.secure_aggregation, "--secure-aggregation"), (config.virtual_clock, "--clock virtual"),
             (getattr(args, "aggregator_ranks", 1) > 1, "--aggregator-ranks"),
             (config.upload_compression.method != "none", "--compression"),
             (args.state is not None, "--state"), (config.checkpoint_dir is not None, "--checkpoint-dir"),
             (privacy_on(args), "--privacy"), (config.max_agent_share is not None, "--max-agent-share"),
             (typed_rounds, "--rounds")]
    named = [flag for on, flag in asked if on]
    if not named:
        return None
    resumable = " (a ServerApp run is not resumable)" if args.state is not None or config.checkpoint_dir else ""
    rounds_hint = ", or " + ROUNDS_HINT if typed_rounds else ""
    return (f"{', '.join(named)}: with --flower-app the app's ServerApp decides rounds, sampling and aggregation, so "
            f"fedpar cannot apply it; drop it{resumable}{rounds_hint}, or add --strategy NAME to let fedpar drive the "
            "app's ClientApps")


def serve_flower_app(args: argparse.Namespace) -> int:
    """Serve the ServerApp of ``args.flower_app`` until its ``main`` returns; write metrics, the final arrays and
    summary.json under ``--out``, whose earlier run's files are kept until this run writes a round."""
    from fedpar.simulations.run_outputs import EarlierRun

    with hold_output_folder(args.out):  # as simulate and train: export (and another run) can tell a run writes there
        earlier = EarlierRun(Path(args.out))  # a ServerApp's run does not resume (--checkpoint-dir is refused)
        try:
            return _serve(args, earlier)
        finally:
            earlier.settle()  # no round written (refused, stopped or failed before one): nothing of it is lost


def _serve(args: argparse.Namespace, earlier: EarlierRun) -> int:
    """:func:`serve_flower_app`'s run, ``earlier`` let go once it wrote a round."""
    from fedpar.aggregation import build_strategy
    from fedpar.cli.compression_options import compression_from_args
    from fedpar.server.app import CoordinatorServer
    from fedpar.server.flower_grid import server_app_main
    from fedpar.server.flower_rounds import FlowerCoordinator
    from fedpar.simulations.run_outputs import RunOutputs, write_run_outputs
    from fedpar.tasks.flower_app import load_flower_app

    try:
        config = from_args(CoordinatorConfig, args)
        config.upload_compression = compression_from_args(args)
        config.metrics_path = Path(args.out) / "metrics.jsonl"
        problem = server_app_refusal(config, args)
        if problem:
            raise ValueError(problem)
        security = server_security(args)
        app = load_flower_app(args.flower_app, args.run_config)
        config.flower_run_config = app.run_config  # every task carries it to the agents' ClientApps
        coordinator = FlowerCoordinator(config, build_strategy("fedavg"),
                                        server_app_main(app.server_app, app.run_config,
                                                        config.wait_for_agents_seconds or float("inf")),
                                        admission=security.admission)
    except ValueError as exc:  # TlsSetupError, FlowerAppError: one line each
        print(f"fedpar serve: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    observers = Observers(args)  # --metrics-port and --tensorboard, fed by each Message exchange's row
    server = CoordinatorServer(coordinator, host=args.host, port=args.port, credentials=security.credentials)
    if args.port_file:
        server.on_listening = lambda port: atomic_write_bytes(args.port_file, [f"{port}\n".encode()])
    stopped_by: KeyboardInterrupt | None = None
    try:
        observers.watch(server)
        server.start()
        where = grpc_target(args.host, server.port)
        print(f"coordinator listening on {where} ({security.description}) for Flower App "
              f"{app.directory.name}; waiting for {counted(config.min_available, 'agent')} (start them with: "
              f"fedpar client --server {where} {security.client_hint} --flower-app DIR --agent-id ID "
              "--partition-index I --num-partitions N)", flush=True)
        server.wait()
        until_told(coordinator)
    except KeyboardInterrupt as exc:
        stopped_by = exc
    finally:
        server.stop(grace=0.5 if stopped_by is not None else 1.0)
        observers.close()
    if server.error is not None:
        from fedpar.task import TaskFailed

        said = str(server.error) if isinstance(server.error, TaskFailed) else \
            f"the ServerApp failed: {type(server.error).__name__}: {server.error}"
        print(f"fedpar serve: {said}", file=sys.stderr)
        return 1
    outputs = write_run_outputs(Path(args.out), coordinator, {"flower_app": str(app.directory)},
                                {"wall_seconds": time.monotonic() - started, "interrupted": stopped_by is not None,
                                 "flower": coordinator.flower_summary},
                                title=f"Flower App {app.directory.name}, fedpar serve",
                                plots=None if args.plot else False)
    written = [] if earlier.settle() else outputs.written  # no round: the earlier run's files are back
    print(RunOutputs(outputs.summary, written).wrote_line(args.out))
    return run_exit_code("fedpar serve", outputs.summary, signal_name(stopped_by) if stopped_by else None)
