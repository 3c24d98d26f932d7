"""Bad input is refused with a clear status and changes nothing; only the valid update counts."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.client.transfer import upload_messages
from fedpar.server.rounds import MAX_REFUSAL_CHARS, Refusal

SHAPES = ((6, 4), (4,))


def _arrays(value=None, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) if value is None else np.full(s, value, np.float32)
            for s in SHAPES]


def _refused(call, code, *fragments):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, (err.value.code(), err.value.details())
    for fragment in fragments:
        assert fragment in err.value.details(), err.value.details()


def test_every_kind_of_bad_upload_is_refused_and_only_valid_ones_count(start_coordinator, agents):
    init = _arrays(seed=0)
    names = ["t0", "t1"]
    ids = ["shape", "dtype", "nan", "inf", "dup", "chunk", "trunc", "order", "good"]
    server = start_coordinator(init, clients_per_round=len(ids), min_available=len(ids), deadline_seconds=60)
    bots = dict(zip(ids, agents(server.address, ids)))
    tasks = {i: bots[i].task() for i in ids}
    layout = ModelLayout.of_arrays(names, init)

    # Wrong shapes and dtypes are refused at the header, before any data is accepted.
    bad_shape = [np.zeros((4, 6), np.float32), np.zeros(4, np.float32)]
    _refused(lambda: bots["shape"].upload(tasks["shape"], bad_shape, 10, names), grpc.StatusCode.INVALID_ARGUMENT,
             "does not match the global model", "'t0'")
    bad_dtype = [a.astype(np.float64) for a in init]
    _refused(lambda: bots["dtype"].upload(tasks["dtype"], bad_dtype, 10, names), grpc.StatusCode.INVALID_ARGUMENT,
             "float32")

    # NaN and Inf are found after the stream completes and refuse the whole update.
    nan = _arrays(seed=3)
    nan[1][2] = np.nan
    _refused(lambda: bots["nan"].upload(tasks["nan"], nan, 10, names), grpc.StatusCode.INVALID_ARGUMENT,
             "'t1'", "NaN or Inf")
    inf = _arrays(seed=4)
    inf[0][1, 1] = np.inf
    _refused(lambda: bots["inf"].upload(tasks["inf"], inf, 10, names), grpc.StatusCode.INVALID_ARGUMENT, "'t0'")

    # Unknown agent / bad token, stale round id, duplicate upload.
    good = _arrays(seed=7)
    stranger = pb.AgentAuth(agent_id="nobody", token="x")
    _refused(lambda: bots["good"].upload(tasks["good"], None, 0, messages=list(
        upload_messages(stranger, tasks["good"], layout, good, 10, 1, {}, 1024))),
        grpc.StatusCode.UNAUTHENTICATED, "unknown agent")
    forged = pb.AgentAuth(agent_id="good", token="forged")
    _refused(lambda: bots["good"].upload(tasks["good"], None, 0, messages=list(
        upload_messages(forged, tasks["good"], layout, good, 10, 1, {}, 1024))),
        grpc.StatusCode.UNAUTHENTICATED, "bad session token")
    stale = pb.TrainTask()
    stale.CopyFrom(tasks["good"])
    stale.round = 0
    _refused(lambda: bots["good"].upload(stale, good, 10, names), grpc.StatusCode.FAILED_PRECONDITION,
             "current round is 1: it came too late")
    stale.round = 7  # of a run that ended or started over (a service's next run counts from 1)
    _refused(lambda: bots["good"].upload(stale, good, 10, names), grpc.StatusCode.FAILED_PRECONDITION,
             "current round is 1: the run it was for ended or started over")
    _refused(lambda: bots["good"].upload(tasks["good"], good, 10**6, names), grpc.StatusCode.INVALID_ARGUMENT,
             "num_examples")
    dup = _arrays(seed=5)
    assert bots["dup"].upload(tasks["dup"], dup, 20, names).accepted
    _refused(lambda: bots["dup"].upload(tasks["dup"], _arrays(seed=6), 20, names), grpc.StatusCode.ALREADY_EXISTS,
             "duplicates are refused")

    # An oversized chunk: past the gRPC message limit, and past our own chunk limit.
    def chunked(size):
        msgs = list(upload_messages(bots["chunk"].auth, tasks["chunk"], layout, _arrays(seed=8), 10, 1, {}, 1 << 20))
        msgs[1] = pb.UploadChunk(data=pb.DataChunk(offset=0, data=b"\0" * size))
        return msgs
    _refused(lambda: bots["chunk"].upload(tasks["chunk"], None, 0, messages=chunked(1 << 20)),
             grpc.StatusCode.RESOURCE_EXHAUSTED)
    _refused(lambda: bots["chunk"].upload(tasks["chunk"], None, 0, messages=chunked((64 << 10) + 100)),
             grpc.StatusCode.INVALID_ARGUMENT, "exceeds the limit")

    # A truncated stream (no UploadEnd) is refused; the agent may then send a complete update.
    msgs = list(upload_messages(bots["trunc"].auth, tasks["trunc"], layout, _arrays(seed=9), 10, 1, {}, 32))
    _refused(lambda: bots["trunc"].upload(tasks["trunc"], None, 0, messages=msgs[:3]),
             grpc.StatusCode.INVALID_ARGUMENT, "without an UploadEnd")
    retry = _arrays(seed=10)
    assert bots["trunc"].upload(tasks["trunc"], retry, 30, names).accepted

    # Out-of-order chunks.
    msgs = list(upload_messages(bots["order"].auth, tasks["order"], layout, _arrays(seed=11), 10, 1, {}, 32))
    msgs[1], msgs[2] = msgs[2], msgs[1]
    _refused(lambda: bots["order"].upload(tasks["order"], None, 0, messages=msgs),
             grpc.StatusCode.INVALID_ARGUMENT, "in order")

    assert all(a.tobytes() == b.tobytes() for a, b in zip(server.coordinator.weights, init))
    # A refused header leaves the agent free to send a correct update.
    fixed_shape, fixed_dtype = _arrays(seed=12), _arrays(seed=13)
    assert bots["shape"].upload(tasks["shape"], fixed_shape, 15, names).accepted
    assert bots["dtype"].upload(tasks["dtype"], fixed_dtype, 25, names).accepted
    assert bots["good"].upload(tasks["good"], good, 50, names).accepted
    assert server.wait(30)

    row = server.coordinator.metrics.last
    assert (row["reported"], row["rejected"], row["late"]) == (5, 4, 0)
    parts = [(20, dup), (30, retry), (15, fixed_shape), (25, fixed_dtype), (50, good)]
    expected = [sum(n * u[i].astype(np.float64) for n, u in parts) / 140 for i in range(2)]
    for new, exp in zip(server.coordinator.weights, expected):
        np.testing.assert_allclose(new, exp, rtol=1e-6, atol=1e-7)


def test_calls_from_unknown_agents_and_bad_joins_are_refused(start_coordinator, agents):
    server = start_coordinator(_arrays(), clients_per_round=1, min_available=1)
    (bot,) = agents(server.address, ["a"])
    _refused(lambda: bot.stub.PullTask(pb.PullTaskRequest(auth=pb.AgentAuth(agent_id="ghost", token="t"))),
             grpc.StatusCode.UNAUTHENTICATED, "call Join first")
    _refused(lambda: bot.stub.Heartbeat(pb.HeartbeatRequest(auth=pb.AgentAuth(agent_id="a", token="t"))),
             grpc.StatusCode.UNAUTHENTICATED, "bad session token")
    _refused(lambda: bot.stub.Join(pb.JoinRequest(agent_id="", num_examples=1)), grpc.StatusCode.INVALID_ARGUMENT,
             "agent_id")
    _refused(lambda: bot.stub.Join(pb.JoinRequest(agent_id="x", num_examples=-5)), grpc.StatusCode.INVALID_ARGUMENT,
             "num_examples")
    _refused(lambda: bot.stub.DownloadWeights(pb.DownloadRequest(auth=bot.auth, round=7, task_id="x")).next(),
             grpc.StatusCode.FAILED_PRECONDITION, "not the current round")


def test_a_refusal_quoting_a_huge_field_still_says_why(start_coordinator, agents):
    """A status message echoing a 40 KB id, task id, dtype or shape would pass gRPC's 16 KiB trailer limit: the agent
    would hear 'metadata size exceeds hard limit', not why. The echo is cut, and every refusal fits."""
    init = _arrays()
    server = start_coordinator(init, clients_per_round=1, min_available=1)
    (bot,) = agents(server.address, ["a"])
    task = bot.task()
    huge = "x" * 40_000
    stranger = pb.AgentAuth(agent_id=huge, token="t")
    _refused(lambda: bot.stub.Heartbeat(pb.HeartbeatRequest(auth=stranger)), grpc.StatusCode.UNAUTHENTICATED,
             "call Join first")
    _refused(lambda: bot.stub.DownloadWeights(pb.DownloadRequest(auth=bot.auth, round=1, task_id=huge)).next(),
             grpc.StatusCode.FAILED_PRECONDITION, "is not the current task of 'a'")
    _refused(lambda: next(bot.stub.HostTaskStream(iter([pb.PullHostTasksRequest(host=stranger)]))),
             grpc.StatusCode.UNAUTHENTICATED, "call JoinPopulation again")
    header = pb.UploadHeader(auth=bot.auth, round=1, task_id=task.task_id, num_examples=10, total_bytes=112)
    for tensors, why in (([pb.TensorSpec(name="t0", dtype=huge, shape=[6, 4])], "is not one of float16"),
                         ([pb.TensorSpec(name="t0", dtype="float32", shape=[1] * 6000)], "6000 dims, at most 8")):
        del header.tensors[:]
        header.tensors.extend(tensors)
        _refused(lambda: bot.stub.UploadSmall(pb.SmallUpload(header=header)), grpc.StatusCode.INVALID_ARGUMENT, why)
    header.task_id = huge
    _refused(lambda: bot.stub.UploadSmall(pb.SmallUpload(header=header)), grpc.StatusCode.FAILED_PRECONDITION,
             "is not the current task of 'a'")
    assert bot.upload(task, _arrays(seed=1), 10).accepted  # none of it cost the agent its update


def test_every_refusal_message_fits_a_grpc_status():
    long = Refusal(grpc.StatusCode.INVALID_ARGUMENT, "what: " + "\u00e9" * 100_000 + " :what to do")
    assert len(long.message) <= MAX_REFUSAL_CHARS
    assert long.message.startswith("what: ") and long.message.endswith(" :what to do")
    assert len(long.message.encode()) * 3 < 16 << 10  # percent-encoded, every byte at most 3


def test_a_reported_metric_that_is_huge_or_not_a_printable_name_is_refused_and_the_rounds_means_stay_finite(
        start_coordinator, agents):
    """One agent's train_loss of 1e300 (finite, so it passed) made the round's example-weighted train_loss inf (null
    in metrics.jsonl), and a metric named with control characters became a metrics column: both are refused, the
    metric named."""
    init = _arrays()
    server = start_coordinator(init, clients_per_round=3, min_available=3)
    bots = agents(server.address, ["rogue", "h1", "h2"])
    tasks = {b.agent_id: b.task() for b in bots}
    layout = ModelLayout.of_arrays(["t0", "t1"], init)

    def upload(bot, metrics, examples=100):
        messages = upload_messages(bot.auth, tasks[bot.agent_id], layout, _arrays(seed=1), examples, 1, metrics, 1024)
        return bot.upload(tasks[bot.agent_id], None, 0, messages=list(messages))
    rogue, h1, h2 = bots
    for metrics, named in (({"train_loss": 1e300}, "'train_loss' = 1e+300"),
                           ({"eval_examples": 1e200, "eval_loss": 1.0}, "'eval_examples'"),
                           ({"train_\x1b[2J\nloss": 1.0}, "printable")):
        _refused(lambda: upload(rogue, metrics), grpc.StatusCode.INVALID_ARGUMENT, named)
    assert upload(rogue, {"train_loss": 0.1}).accepted  # a refused report is not final: it may report again
    assert upload(h1, {"train_loss": 0.5}).accepted and upload(h2, {"train_loss": 0.9}).accepted
    assert server.wait(30)
    row = server.coordinator.metrics.last
    assert row["status"] == "ok" and row["train_loss"] == pytest.approx(0.5)
    assert not any("\x1b" in k for k in row)


def test_an_agent_naming_new_metrics_every_round_widens_the_rows_only_up_to_the_cap(start_coordinator, agents,
                                                                                    monkeypatch):
    """Each new metric name became a column, and metrics.csv was rewritten whole for it: one agent naming new ones
    every round rewrote it every round, for the whole run. The rows take the run's first MAX_CLIENT_METRICS names."""
    from fedpar.server import coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "MAX_CLIENT_METRICS", 3)
    init = _arrays()
    server = start_coordinator(init, clients_per_round=2, min_available=2, rounds=3)
    bots = agents(server.address, ["rogue", "h1"])
    layout = ModelLayout.of_arrays(["t0", "t1"], init)
    for r in range(3):
        for bot in bots:
            task = bot.task()
            metrics = {"train_loss": 0.5, f"train_new{r}a": 1.0, f"train_new{r}b": 1.0} if bot.agent_id == "rogue" \
                else {"train_loss": 0.5}
            messages = upload_messages(bot.auth, task, layout, _arrays(seed=1), 100, 1, metrics, 1024)
            assert bot.upload(task, None, 0, messages=list(messages)).accepted
    assert server.wait(30)
    rows = list(server.coordinator.metrics.read_rows())
    assert [r["status"] for r in rows] == ["ok"] * 3
    taken = {k for row in rows for k in row if k.startswith("train_")}
    assert taken == {"train_loss", "train_new0a", "train_new0b"}  # the first three names; later ones left out
    assert server.coordinator.metrics.csv_path.read_text().splitlines()[0].count("train_") == 3


def test_an_agents_weight_in_the_federated_evaluation_is_at_most_its_weight_in_the_model(start_coordinator, agents):
    """eval_examples is the agent's own word: one that said 1e99 (within the metric bound) made the round's
    federated_eval_accuracy its own, whatever the others measured."""
    init = _arrays()
    server = start_coordinator(init, clients_per_round=3, min_available=3)
    bots = agents(server.address, ["rogue", "h1", "h2"])
    tasks = {b.agent_id: b.task() for b in bots}
    layout = ModelLayout.of_arrays(["t0", "t1"], init)

    def upload(bot, metrics):
        messages = upload_messages(bot.auth, tasks[bot.agent_id], layout, _arrays(seed=1), 100, 1, metrics, 1024)
        return bot.upload(tasks[bot.agent_id], None, 0, messages=list(messages))
    assert upload(bots[0], {"eval_examples": 1e99, "eval_accuracy": 0.0}).accepted
    assert all(upload(bot, {"eval_examples": 100.0, "eval_accuracy": 0.9}).accepted for bot in bots[1:])
    assert server.wait(30)
    assert server.coordinator.metrics.last["federated_eval_accuracy"] == pytest.approx(0.6)  # 100 examples each
