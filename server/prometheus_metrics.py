"""A Prometheus endpoint for the coordinator (``fedpar serve --metrics-port``), fed by its metrics rows.

Round figures come from each round's metrics row (the row metrics.jsonl gets: one bookkeeping, two views);
agent counts are read from the registry on the coordinator's event loop when Prometheus scrapes.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("fedpar.server")
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, float("inf"))
UPLOAD_OUTCOMES = {"accepted": "reported", "rejected": "rejected", "late": "late"}  # label: row key
RUN_STATES = ["running", "finished", "failed", "stopped"]  # a service's run: running, or how it ended


def _checkpointed_round(root) -> int:
    """The round of the checkpoint under ``root`` that a coordinator not yet restored resumes after, read from its
    pointer alone (a large model's restore takes a while); 0 for none, or one that cannot be read."""
    from fedpar.server.checkpoint import CheckpointError, latest_round

    try:
        return latest_round(root) or 0
    except CheckpointError:
        return 0


class _AgentCounts:
    """Collector of fedpar_agents{state="registered"|"live"}, counted on the coordinator's loop at each scrape."""

    def __init__(self, server):
        self.server = server
        self.last = (0, 0)

    def collect(self):
        """The registry's counts (the last known ones if the loop is busy or stopped)."""
        registry = self.server.coordinator.registry
        try:
            self.last = self.server.on_loop(lambda: (len(registry), len(registry.live_ids())))
        except (RuntimeError, TimeoutError):
            pass
        family = GaugeMetricFamily("fedpar_agents", "agents known to the coordinator: registered (joined, "
                                   "liveness not yet expired) and live (may be sampled)", labels=["state"])
        family.add_metric(["registered"], self.last[0])
        family.add_metric(["live"], self.last[1])
        yield family


class PrometheusExporter:
    """The coordinator's Prometheus metrics; :meth:`observe` is an on_round_end callback."""

    def __init__(self, server, privacy: bool = False, runs: bool = False):
        self.registry = CollectorRegistry()
        r = self.registry
        run = ["run"] if runs else []  # a service's runs: every round figure carries its run's id
        self.run: str | None = None
        self.rounds = Counter("fedpar_rounds", "rounds ended, by status (ok or failed)", ["status", *run],
                              registry=r)
        self.last_round = Gauge("fedpar_round", "the last round that ended", run, registry=r)
        self.uploads = Counter("fedpar_uploads", "updates of sampled agents by outcome: accepted, rejected (bad "
                               "content) or late", ["outcome", *run], registry=r)
        self.refusals = Counter("fedpar_upload_refusals", "refused upload attempts by gRPC status (busy, limits, "
                                "malformed, late); an agent may retry some", ["reason", *run], registry=r)
        self.bytes = Counter("fedpar_model_bytes", "model tensor bytes: in = accepted uploads, out = weights sent",
                             ["direction", *run], registry=r)
        self.round_seconds = Histogram("fedpar_round_seconds", "wall seconds per round", run, registry=r,
                                       buckets=SECONDS_BUCKETS)
        self.fold_seconds = Histogram("fedpar_fold_seconds", "seconds spent folding updates per round (all "
                                      "aggregator ranks)", run, registry=r, buckets=SECONDS_BUCKETS)
        self.ranks_live = Gauge("fedpar_aggregator_ranks_live", "aggregator ranks in the coordinator's group at the "
                                "last round's close (fewer than started: ranks were lost)", run, registry=r)
        self.dp_epsilon = Gauge("fedpar_dp_epsilon", "differential privacy budget spent so far (epsilon at "
                                "--privacy-delta)", run, registry=r) if privacy else None
        self.run_state = Enum("fedpar_run_state", "the service's run: running, or how it ended (finished, failed, "
                              "stopped)", run, states=RUN_STATES, registry=r) if runs else None
        self._agents = _AgentCounts(server)
        if not runs:
            self._present_at_zero()
            self._resumed(server)
        r.register(self._agents)
        self._http = None

    def _present_at_zero(self) -> None:
        """Every labelled series at 0 from the first scrape (of the run now observed)."""
        for status in ("ok", "failed"):
            self._of(self.rounds, status)
        for outcome in UPLOAD_OUTCOMES:
            self._of(self.uploads, outcome)
        for direction in ("in", "out"):
            self._of(self.bytes, direction)

    def _resumed(self, server) -> None:
        """fedpar_round at the last round ``server``'s coordinator completed: a checkpoint's after a restart (else a
        scrape says 0 until the next round ends, as if the run had started over), whether ``server`` is followed
        before its checkpoint is restored (a service's run, a simulation) or after (one-shot serve)."""
        coordinator, gauge = server.coordinator, self._of(self.last_round)
        gauge.set(coordinator.round_id or _checkpointed_round(coordinator.config.checkpoint_dir))  # while it restores
        coordinator.on_restored.append(lambda: gauge.set(coordinator.round_id))
        # Until a round closes, the ranks it started with (0 read as every rank lost: an alert fired at each start).
        self._of(self.ranks_live).set(coordinator.ranks.world if coordinator.ranks is not None else 1)

    def _of(self, metric, *labels: str):
        """``metric``'s series for ``labels`` (and the current run's id, when runs are labelled)."""
        labels = (*labels, self.run) if self.run is not None else labels
        return metric.labels(*labels) if labels else metric

    def follow(self, server, run_id) -> None:
        """From now on observe run ``run_id`` served by ``server`` (a service's next run), dropping the series of the
        runs before it."""
        self._agents.server = server
        if self.run is not None and self.run != str(run_id):
            self._drop_runs()
        self.run = str(run_id)
        self._present_at_zero()
        self._resumed(server)
        if self.run_state is not None:
            self._of(self.run_state).state("running")

    def ended(self, run_id, status: str) -> None:
        """Run ``run_id`` ended ``status`` (finished, failed or stopped): said while its series are kept, until the
        next run starts (an endpoint without it read as a run still going)."""
        if self.run_state is not None and self.run == str(run_id) and status in RUN_STATES:
            self._of(self.run_state).state(status)

    def _drop_runs(self) -> None:
        """Remove every run-labelled series: a service's endpoint (and memory) would otherwise grow by some 40 series
        a run, for as long as the service lives; the last run's are kept until the next one starts."""
        for metric in (self.rounds, self.last_round, self.uploads, self.refusals, self.bytes, self.round_seconds,
                       self.fold_seconds, self.ranks_live, self.dp_epsilon, self.run_state):
            if metric is not None:
                metric.clear()

    def observe(self, row: dict) -> None:
        """Count one round's metrics row."""
        self._of(self.rounds, "ok" if row.get("status") == "ok" else "failed").inc()
        self._of(self.last_round).set(row["round"])
        for outcome, key in UPLOAD_OUTCOMES.items():
            self._of(self.uploads, outcome).inc(row.get(key) or 0)
        for key, value in row.items():
            if key.startswith("refused_") and value:
                self._of(self.refusals, key[len("refused_"):]).inc(value)
        self._of(self.bytes, "in").inc(row.get("upload_bytes") or 0)
        self._of(self.bytes, "out").inc(row.get("download_bytes") or 0)
        if row.get("round_seconds") is not None:
            self._of(self.round_seconds).observe(row["round_seconds"])
        fold = [v for k, v in row.items() if k.startswith("r") and k.endswith("_fold_s") and v is not None]
        if fold:
            self._of(self.fold_seconds).observe(sum(fold))
        self._of(self.ranks_live).set(row.get("ranks_live", 1))  # a row without it: a one-rank coordinator
        if self.dp_epsilon is not None and row.get("dp_epsilon") is not None:
            self._of(self.dp_epsilon).set(row["dp_epsilon"])

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP on ``host:port`` (0: a free port) from a thread; returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self._http.server_port
        return bound

    def close(self) -> None:
        """Stop the HTTP endpoint."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
