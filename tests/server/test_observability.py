"""The coordinator's health service, Prometheus endpoint and TensorBoard scalars, over real gRPC and HTTP on
127.0.0.1."""

from __future__ import annotations

import io
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.server.prometheus_metrics import PrometheusExporter
from support.held_restore import held_restore

NAMES = ["t0", "t1"]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _weights(seed=0, rows=40):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((rows, 30), (30,))]


BIG_ROWS = 2400  # a model above SMALL_UPDATE_BYTES (256 KiB): its download is built on a worker thread


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5).status


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_health_is_not_serving_until_the_coordinator_is_ready_and_after_its_last_round(start_coordinator, agents):
    # Hold every worker thread of the coordinator, as a slow start (building the first download of a model that is
    # not small) would: it listens, but cannot serve rounds yet.
    from fedpar.server.app import CoordinatorServer
    from fedpar.server.coordinator import Coordinator
    from fedpar.server.config import CoordinatorConfig
    from fedpar.aggregation import build_strategy

    coordinator = Coordinator(CoordinatorConfig(rounds=1, min_available=1, clients_per_round=1, heartbeat_seconds=1.0),
                              NAMES, _weights(rows=BIG_ROWS), build_strategy("fedavg"))
    release = threading.Event()
    held = [coordinator._executor.submit(release.wait) for _ in range(coordinator._executor._max_workers)]
    server = CoordinatorServer(coordinator)
    server.start()
    try:
        assert _health(server.address) == NOT_SERVING
        assert _health(server.address, "fedpar.v1.Coordinator") == NOT_SERVING
        release.set()
        for future in held:
            future.result(timeout=5)
        for _ in range(50):
            if _health(server.address) == SERVING:
                break
            threading.Event().wait(0.05)
        assert _health(server.address) == SERVING
        (bot,) = agents(server.address, ["a"])
        task = bot.task()
        update = _weights(1, rows=BIG_ROWS)
        assert bot.upload(task, update, 10, names=NAMES).accepted
        assert server.wait(30)
        # The last round is done; the server still answers (agents hear "shutdown") but no longer serves rounds.
        assert _health(server.address) == NOT_SERVING
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        release.set()
        server.stop()


def test_health_calls_are_strangers_never_taking_an_agents_place(start_coordinator, agents):
    server = start_coordinator(_weights(), NAMES, min_available=1, clients_per_round=1, max_concurrent_rpcs=2)
    (bot,) = agents(server.address, ["a"])
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30) for _ in range(3)]
        assert [next(w).status for w in watches] == [SERVING] * 3
        assert len(server.strangers) == 3  # held in the strangers' bounds, not --max-concurrent-rpcs (2)
        assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == SERVING
        reply = bot.stub.Heartbeat(pb.HeartbeatRequest(auth=bot.auth), timeout=5)  # the agent's calls still pass
        assert reply is not None
        for w in watches:
            w.cancel()
    for _ in range(100):
        if len(server.strangers) == 0:
            break
        threading.Event().wait(0.02)
    assert len(server.strangers) == 0


def test_prometheus_endpoint_counts_rounds_uploads_refusals_bytes_and_agents(start_coordinator, agents):
    init = _weights()
    layout = ModelLayout.of_arrays(NAMES, init)
    server = start_coordinator(init, NAMES, rounds=2, min_available=2, clients_per_round=2, deadline_seconds=1.5,
                               inline_weights_max_bytes=0)
    exporter = PrometheusExporter(server)
    server.coordinator.on_round_end.append(exporter.observe)
    port = exporter.serve("127.0.0.1", 0)
    try:
        a, b = agents(server.address, ["a", "b"])
        before = _scrape(port)
        assert before[("fedpar_agents", (("state", "registered"),))] == 2
        assert before[("fedpar_agents", (("state", "live"),))] == 2
        assert before[("fedpar_rounds_total", (("status", "ok"),))] == 0
        # Round 1: a's update is accepted; b's holds a NaN, refused for good (INVALID_ARGUMENT).
        ta, tb = a.task(), b.task()
        a.download(ta, layout)
        b.download(tb, layout)
        assert a.upload(ta, _weights(1), 10, names=NAMES).accepted
        bad = _weights(2)
        bad[0][0, 0] = np.nan
        with pytest.raises(grpc.RpcError) as err:
            b.upload(tb, bad, 10, names=NAMES)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Round 2: nobody uploads; it fails at its deadline.
        a.task()
        assert server.wait(30)
        rows = list(server.coordinator.metrics.read_rows())
        got = _scrape(port)
    finally:
        exporter.close()
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert got[("fedpar_rounds_total", (("status", "ok"),))] == 1
    assert got[("fedpar_rounds_total", (("status", "failed"),))] == 1
    assert got[("fedpar_round", ())] == 2
    assert got[("fedpar_uploads_total", (("outcome", "accepted"),))] == 1
    assert got[("fedpar_uploads_total", (("outcome", "rejected"),))] == 1
    assert got[("fedpar_upload_refusals_total", (("reason", "invalid_argument"),))] == 1
    assert rows[0]["refused_invalid_argument"] == 1
    assert got[("fedpar_model_bytes_total", (("direction", "in"),))] == layout.total_bytes
    assert got[("fedpar_model_bytes_total", (("direction", "out"),))] == 2 * layout.total_bytes == \
        rows[0]["download_bytes"]
    assert got[("fedpar_round_seconds_count", ())] == 2
    assert got[("fedpar_round_seconds_sum", ())] == pytest.approx(sum(r["round_seconds"] for r in rows))
    assert got[("fedpar_fold_seconds_count", ())] == 2
    assert ("fedpar_dp_epsilon", ()) not in got  # no DP in this run
    assert got[("fedpar_aggregator_ranks_live", ())] == 1


def test_tensorboard_scalars_and_csv_of_a_real_round_read_back(start_coordinator, agents, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'fedpar[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedpar.protocol.run_logs import TensorBoardScalars

    writer = TensorBoardScalars(tmp_path / "tb")
    server = start_coordinator(_weights(), NAMES, rounds=2, min_available=1, clients_per_round=1,
                               metrics_path=tmp_path / "out" / "metrics.jsonl")
    server.coordinator.on_round_end.append(writer.write)
    (bot,) = agents(server.address, ["a"])
    for seed in (1, 2):
        assert bot.upload(bot.task(), _weights(seed), 10, names=NAMES).accepted
    assert server.wait(30)
    writer.close()
    rows = list(server.coordinator.metrics.read_rows())
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"reported", "upload_bytes", "round_seconds"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("reported")] == [(1, 1.0), (2, 1.0)]
    assert [e.value for e in events.Scalars("round_seconds")] == pytest.approx([r["round_seconds"] for r in rows])
    lines = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    assert len(lines) == 3 and header[:2] == ["round", "status"]
    assert [line.split(",")[header.index("upload_bytes")] for line in lines[1:]] == \
        [str(r["upload_bytes"]) for r in rows]


def test_health_is_not_serving_while_a_checkpoint_is_restored(tmp_path):
    """The port opens first with health NOT_SERVING (agents' calls: UNAVAILABLE, so they retry), then the real
    restore runs, then SERVING. The restore is held until the test has looked (it then runs as always)."""
    from fedpar.aggregation import build_strategy
    from fedpar.protocol.codec import PROTOCOL_VERSION, CoordinatorStub
    from fedpar.server.app import CoordinatorServer
    from fedpar.server.checkpoint import Checkpoint, save_checkpoint
    from fedpar.server.config import CoordinatorConfig
    from fedpar.server.members import CohortSampler

    saved = _weights(7)
    save_checkpoint(tmp_path, Checkpoint(1, NAMES, saved, {}, {"sampler": CohortSampler(0).state(),
                                                               "strategy": build_strategy("fedavg").state_dict()[1]}))
    HeldRestore, release, restoring = held_restore()

    coordinator = HeldRestore(CoordinatorConfig(rounds=2, min_available=1, checkpoint_dir=tmp_path), NAMES,
                              _weights(), build_strategy("fedavg"))
    server = CoordinatorServer(coordinator)
    ports: list[int] = []
    server.on_listening = ports.append
    starting = threading.Thread(target=server.start)
    starting.start()
    try:
        assert restoring.wait(30)
        address = f"127.0.0.1:{ports[0]}"
        assert _health(address) == NOT_SERVING
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                CoordinatorStub(channel).Join(pb.JoinRequest(agent_id="a", num_examples=5,
                                                             protocol_version=PROTOCOL_VERSION), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "restoring its checkpoint" in err.value.details()
        assert coordinator.round_id == 0
        release.set()
        starting.join(30)
        for _ in range(100):
            if _health(address) == SERVING:
                break
            threading.Event().wait(0.05)
        assert _health(address) == SERVING
        assert coordinator.round_id == 1 and all(a.tobytes() == b.tobytes() for a, b in zip(coordinator.weights, saved))
    finally:
        release.set()
        starting.join(30)
        server.stop()


class _Terminal(io.StringIO):
    """What rich writes to a terminal, kept as text."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_shows_a_rounds_uploads_and_deadline_on_a_terminal_only(start_coordinator, agents):
    from fedpar.cli.progress import LiveBar

    server = start_coordinator(_weights(), names=NAMES, rounds=1, min_available=1, clients_per_round=1,
                               deadline_seconds=60.0)
    terminal, pipe = _Terminal(), io.StringIO()
    bars = [LiveBar(stream=terminal), LiveBar(stream=pipe)]
    for bar in bars:
        bar.follow(server.coordinator)  # before the first round: clients joining
    assert "clients joining" in terminal.getvalue() and "0/1" in terminal.getvalue()
    (bot,) = agents(server.address, ["a"])
    task = bot.task()
    for bar in bars:
        bar.follow(server.coordinator)  # round 1 is open, nothing uploaded yet
        bar.close()
    shown = terminal.getvalue()
    assert "round 1: uploads accepted" in shown and "0/1" in shown
    seconds_left = float(shown.rsplit("deadline in ", 1)[1].split(" s", 1)[0])
    assert 0 < seconds_left <= 60
    assert pipe.getvalue() == ""  # not a terminal: nothing beside the per-round lines
    assert bot.upload(task, _weights(1), 10, names=NAMES).accepted
    assert server.wait(30)


def test_the_csv_table_appends_rows_and_is_widened_once_for_an_undeclared_column(tmp_path):
    import csv

    from fedpar.protocol.run_logs import AppendedCsv, csv_bytes

    path = tmp_path / "metrics.csv"
    rows: list[dict] = []  # stands for metrics.jsonl, which has every row before the table does
    table = AppendedCsv(path, ["refused_busy"], lambda: iter(rows))

    def add(row):
        rows.append(row)
        table.append(row)

    add({"round": 1, "loss": 2.0})
    before = path.stat().st_ino
    add({"round": 2, "loss": 1.5, "refused_busy": 1})  # a declared column: appended in place
    assert path.stat().st_ino == before and path.read_bytes() == csv_bytes(rows, ["round", "loss", "refused_busy"])
    add({"round": 3, "accuracy": 0.9, "loss": None})  # an undeclared one: the table is rewritten once, with it
    assert table.rewrites == 1 and path.stat().st_ino != before
    assert path.read_bytes() == csv_bytes(rows, ["round", "loss", "refused_busy", "accuracy"])
    assert [r["accuracy"] for r in csv.DictReader(path.open())] == ["", "", "0.9"]


def test_prometheus_round_after_a_restart_is_the_checkpoints_not_zero(start_coordinator, tmp_path):
    # A coordinator resumed after round 3 was scraped as fedpar_round 0 until round 4 ended, as if the run had
    # started over (a dashboard's round fell to 0, an alert on progress fired).
    from fedpar.aggregation import build_strategy
    from fedpar.server.checkpoint import Checkpoint, save_checkpoint
    from fedpar.server.members import CohortSampler

    state = {"sampler": CohortSampler(0).state(), "strategy": build_strategy("fedavg").state_dict()[1]}
    save_checkpoint(tmp_path / "ck", Checkpoint(3, NAMES, _weights(7), {}, state))
    server = start_coordinator(_weights(), NAMES, rounds=5, min_available=2, checkpoint_dir=tmp_path / "ck")
    exporter = PrometheusExporter(server)
    port = exporter.serve("127.0.0.1", 0)
    try:
        got = _scrape(port)
    finally:
        exporter.close()
    assert server.coordinator.round_id == 3
    assert got[("fedpar_round", ())] == 3
    assert got[("fedpar_rounds_total", (("status", "ok"),))] == 0  # counters count this process's rounds


def test_prometheus_round_of_a_run_followed_before_its_checkpoint_is_restored_is_the_checkpoints(tmp_path):
    # A service's endpoint follows a run before its coordinator starts (and restores): a run resumed after round 3
    # was scraped as fedpar_round{run="2"} 0 until round 4 ended (one-shot serve, attached after the start, said 3).
    from fedpar.aggregation import build_strategy
    from fedpar.server.app import CoordinatorServer
    from fedpar.server.checkpoint import Checkpoint, save_checkpoint
    from fedpar.server.config import CoordinatorConfig
    from fedpar.server.coordinator import Coordinator
    from fedpar.server.members import CohortSampler

    state = {"sampler": CohortSampler(0).state(), "strategy": build_strategy("fedavg").state_dict()[1]}
    save_checkpoint(tmp_path / "ck", Checkpoint(3, NAMES, _weights(7), {}, state))
    idle = CoordinatorServer(Coordinator(CoordinatorConfig(rounds=1, min_available=2), NAMES, _weights(),
                                         build_strategy("fedavg")))
    server = CoordinatorServer(Coordinator(CoordinatorConfig(rounds=5, min_available=2, checkpoint_dir=tmp_path / "ck"),
                                           NAMES, _weights(), build_strategy("fedavg")))
    exporter = PrometheusExporter(idle, runs=True)
    port = exporter.serve("127.0.0.1", 0)
    try:
        exporter.follow(server, 2)
        server.start()
        got = _scrape(port)
    finally:
        server.stop()
        exporter.close()
    assert server.coordinator.round_id == 3
    assert got[("fedpar_round", (("run", "2"),))] == 3


def test_prometheus_round_while_a_checkpoint_is_restored_is_the_checkpoints(tmp_path):
    # An endpoint served before the restore (simulate's, a service's run) said fedpar_round 0 for as long as the
    # checkpoint took to load (a large model's: seconds), as if the run had started over, then jumped back.
    from fedpar.aggregation import build_strategy
    from fedpar.server.app import CoordinatorServer
    from fedpar.server.checkpoint import Checkpoint, save_checkpoint
    from fedpar.server.config import CoordinatorConfig
    from fedpar.server.members import CohortSampler

    state = {"sampler": CohortSampler(0).state(), "strategy": build_strategy("fedavg").state_dict()[1]}
    save_checkpoint(tmp_path, Checkpoint(3, NAMES, _weights(7), {}, state))
    HeldRestore, release, restoring = held_restore()
    server = CoordinatorServer(HeldRestore(CoordinatorConfig(rounds=5, min_available=1, checkpoint_dir=tmp_path),
                                           NAMES, _weights(), build_strategy("fedavg")))
    exporter = PrometheusExporter(server)
    port = exporter.serve("127.0.0.1", 0)
    starting = threading.Thread(target=server.start)
    starting.start()
    try:
        assert restoring.wait(30)
        assert server.coordinator.round_id == 0  # not restored yet
        assert _scrape(port)[("fedpar_round", ())] == 3
        release.set()
        starting.join(30)
        assert server.coordinator.round_id == 3 and _scrape(port)[("fedpar_round", ())] == 3
    finally:
        release.set()
        starting.join(30)
        server.stop()
        exporter.close()
