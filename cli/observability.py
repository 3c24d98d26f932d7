"""The observability options of ``fedpar serve`` and ``fedpar simulate``: a Prometheus endpoint and TensorBoard."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from fedpar.cli.declared import add_declared
from fedpar.cli.privacy import privacy_on
from fedpar.cli.user_errors import UserError, check_folder_writable, check_output_folder, check_port_free
from fedpar.ports import ReservedPort
from fedpar.settings import setting


@dataclass
class Observability:
    """What watches a run from outside: a Prometheus endpoint (serve, simulate) and TensorBoard events."""

    metrics_port: int | None = setting(
        None, check="port", group="observability",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port): rounds, agents, uploads, "
             "refusals, bytes, round and fold seconds, DP epsilon")
    metrics_host: str = setting("127.0.0.1", check="host", group="observability",
                                help="address of the Prometheus endpoint (0.0.0.0 for every interface: it has no "
                                     "authentication)")
    tensorboard: str | None = setting(None, group="observability", metavar="DIR",
                                      help="write per-round (train: per-step) scalars as TensorBoard events to DIR "
                                           "(needs pip install 'fedpar[tensorboard]')")


def add_observability_arguments(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """Add --metrics-port, --metrics-host and --tensorboard (``only``: those of them)."""
    add_declared(p, Observability, only=only)


def check_metrics_endpoint(args: argparse.Namespace) -> None:
    """UserError, naming the flag to change, for a --metrics-host without --metrics-port (no endpoint would be
    served), a host that is not this machine's, or a port another process holds."""
    if args.metrics_port is None and args.metrics_host != Observability.metrics_host:
        raise UserError("--metrics-host applies only with --metrics-port; add it (or drop the option)")
    check_port_free(args.metrics_host, args.metrics_port, "--metrics-port", host_option="--metrics-host")


@contextmanager
def metrics_port_kept(args: argparse.Namespace, avoid: range | tuple = ()) -> Iterator[int | None]:
    """--metrics-port for a process that may be started again (a run resumed after its coordinator died), while the
    block runs: 0 reserves a port free on --metrics-host now, and not in ``avoid`` (the ports ranks will bind), so
    that each start serves the one a scraper was pointed at, and no other process takes it in between."""
    if args.metrics_port != 0:
        yield args.metrics_port
        return
    with ReservedPort(args.metrics_host, avoid) as port:  # the endpoint binds it all the same (SO_REUSEADDR)
        yield port


def require_tensorboard() -> None:
    """A UserError saying how to install tensorboard unless it is importable."""
    from fedpar.protocol.run_logs import check_tensorboard

    try:
        check_tensorboard()
    except RuntimeError as exc:
        raise UserError(str(exc)) from None


def check_tensorboard_folder(log_dir: str) -> None:
    """A UserError saying how to install tensorboard, or what to give --tensorboard instead of ``log_dir`` (a file,
    or a folder this user cannot make or write in)."""
    require_tensorboard()
    check_output_folder(log_dir, "--tensorboard")
    check_folder_writable(log_dir, "--tensorboard")


def tensorboard_writer(log_dir: str | None, step_key: str = "round"):
    """A TensorBoardScalars for ``log_dir`` (None: none); a UserError as :func:`check_tensorboard_folder` says."""
    if not log_dir:
        return None
    from fedpar.protocol.run_logs import TensorBoardScalars

    check_tensorboard_folder(log_dir)
    return TensorBoardScalars(log_dir, step_key)


def tensorboard_resumes(events, coordinator) -> None:
    """Once ``coordinator`` restored its checkpoint (if any), ``events`` (a TensorBoardScalars) gets the metrics row of
    the round it goes on after: repaired by the resume where the run died before writing it, and the round's one point
    (TensorBoardScalars.resume)."""
    coordinator.on_restored.append(
        lambda: events.resume(coordinator.metrics.last if coordinator.round_id else None))


class Observers:
    """What watches a running coordinator: the Prometheus endpoint and the TensorBoard writer."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tensorboard = tensorboard_writer(args.tensorboard)  # first: a missing package fails before any work
        self.exporter = None

    def round_callbacks(self) -> list[Callable[[dict], None]]:
        """Callbacks for each round's metrics row."""
        return [self.tensorboard.write] if self.tensorboard else []

    def attach(self, server) -> None:
        """Start the Prometheus endpoint for ``server`` (a CoordinatorServer) when --metrics-port is set; TensorBoard
        gets the round a resumed coordinator goes on after (:func:`tensorboard_resumes`)."""
        if self.tensorboard is not None:
            tensorboard_resumes(self.tensorboard, server.coordinator)
        if self.args.metrics_port is None:
            return
        from fedpar.server.prometheus_metrics import PrometheusExporter

        self._serve_exporter(PrometheusExporter(server, privacy=privacy_on(self.args)))
        server.coordinator.on_round_end.append(self.exporter.observe)

    def watch(self, server) -> None:
        """Have ``server`` (a CoordinatorServer) feed the Prometheus endpoint (:meth:`attach`) and TensorBoard."""
        self.attach(server)
        server.coordinator.on_round_end.extend(self.round_callbacks())

    def attach_service(self, idle_server) -> None:
        """A service's one endpoint, served from its start (``idle_server``: its idle coordinator's server, whose
        agents it counts until a run's follows) when --metrics-port is set; UserError if it cannot be bound."""
        if self.args.metrics_port is None:
            return
        from fedpar.server.prometheus_metrics import PrometheusExporter

        self._serve_exporter(PrometheusExporter(idle_server, privacy=True, runs=True))

    def attach_run(self, server, run_id) -> None:
        """Have the service's endpoint (:meth:`attach_service`) follow run ``run_id``, served by ``server``: its
        round figures carry a ``run`` label."""
        if self.exporter is None:
            return
        self.exporter.follow(server, run_id)
        server.coordinator.on_round_end.append(self.exporter.observe)

    def run_ended(self, run_id, status: str) -> None:
        """Tell the service's endpoint that run ``run_id`` ended ``status`` (finished, failed or stopped)."""
        if self.exporter is not None:
            self.exporter.ended(run_id, status)

    def _serve_exporter(self, exporter) -> None:
        """Serve ``exporter`` and keep it (only once it is served: a port it could not bind leaves none)."""
        from fedpar.protocol.codec import grpc_target  # host:port, an IPv6 address in brackets as URLs want it

        host = self.args.metrics_host
        try:
            bound = exporter.serve(host, self.args.metrics_port)
        except OSError as exc:
            raise UserError(f"cannot serve metrics on {grpc_target(host, self.args.metrics_port)}: "
                            f"{exc.strerror}; pick another --metrics-port (0 picks a free one)") from None
        self.exporter = exporter
        print(f"Prometheus metrics at http://{grpc_target(host, bound)}/metrics", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the endpoint and flush the event file."""
        if self.exporter is not None:
            self.exporter.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
