"""Secure aggregation over real gRPC on loopback: equals FedAvg, survives dropouts, fails cleanly past them."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from fedpar.aggregation import build_strategy
from fedpar.client.secure_upload import SecureSession, SecureUpload, flat_update
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout

IDS = ["a", "b", "c", "d", "e"]
COUNTS = {"a": 10, "b": 25, "c": 65, "d": 40, "e": 90}
SECURE = dict(secure_aggregation=True, clients_per_round=5, min_available=5, secagg_stage_seconds=2.0)


def _weights(seed=0, shapes=((20, 30), (30,), (30, 5))):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _names(weights):
    return [f"t{i}" for i in range(len(weights))]


def _local(init, seed):
    """A trained model: the global plus a delta well inside the clip range."""
    rng = np.random.default_rng(seed)
    return [(w + rng.uniform(-0.5, 0.5, w.shape)).astype(np.float32) for w in init]


def _play(bot, init, local, count, drop, errors):
    """One agent's whole secure round; ``drop`` = where it vanishes (None, 'before_upload', 'after_upload')."""
    try:
        layout = ModelLayout.of_arrays(_names(init), init)
        task = bot.task()
        session = SecureSession(bot.stub, bot.auth, task, poll_seconds=1.0, stage_timeout=30.0)
        session.begin(sum(w.size for w in init))
        global_weights = bot.download(task, layout)
        if drop == "before_upload":
            return
        reply = session.upload_masked(flat_update(local, global_weights), count, {"train_loss": 1.0},
                                      bot.max_chunk, timeout=30.0)
        assert reply.accepted
        if drop == "after_upload":
            return
        session.unmask()
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.ABORTED:  # ABORTED: the round failed, which some tests expect
            errors.append(f"{bot.agent_id}: {err.code().name}: {err.details()}")
    except Exception as exc:  # noqa: BLE001 - reported to the test thread
        errors.append(f"{bot.agent_id}: {exc!r}")


def _run(server, bots, init, drops):
    locals_ = {b.agent_id: _local(init, i + 1) for i, b in enumerate(bots)}
    errors: list[str] = []
    threads = [threading.Thread(target=_play, args=(b, init, locals_[b.agent_id], COUNTS[b.agent_id],
                                                    drops.get(b.agent_id), errors)) for b in bots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert server.wait(60)
    return locals_, errors


def _fedavg(locals_, ids):
    total = sum(COUNTS[i] for i in ids)
    return [sum(COUNTS[i] * locals_[i][k].astype(np.float64) for i in ids) / total
            for k in range(len(next(iter(locals_.values()))))]


@pytest.mark.parametrize("drops", [{}, {"b": "after_upload", "e": "after_upload"}],
                         ids=["everyone", "two-drop-after-masking"])
def test_secure_round_equals_plain_fedavg(start_coordinator, agents, drops):
    init = _weights()
    server = start_coordinator(init, **SECURE)
    bots = agents(server.address, IDS)
    locals_, errors = _run(server, bots, init, drops)
    assert not errors, errors
    row = server.coordinator.metrics.last
    assert (row["status"], row["reported"], row["secagg_survivors"]) == ("ok", 5, 5)
    assert row["examples"] == sum(COUNTS.values())
    assert row["secagg_error_bound"] < 1e-6
    assert "train_loss" not in row  # the agents' per-agent metrics are not kept in secure rounds
    for new, exp in zip(server.coordinator.weights, _fedavg(locals_, IDS)):
        assert new.dtype == np.float32
        np.testing.assert_allclose(new, exp, rtol=0, atol=1e-5)


def test_agents_dropping_before_their_upload_have_their_masks_removed(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, **SECURE, deadline_seconds=5.0)
    bots = agents(server.address, IDS)
    locals_, errors = _run(server, bots, init, {"a": "before_upload", "c": "after_upload"})
    assert not errors, errors
    row = server.coordinator.metrics.last
    assert (row["status"], row["secagg_survivors"], row["secagg_dropped"]) == ("ok", 4, 1)
    assert (row["late"], row["silent"], row["not_needed"], row["secagg_not_needed"]) == (0, 1, 0, 0)
    for new, exp in zip(server.coordinator.weights, _fedavg(locals_, ["b", "c", "d", "e"])):
        np.testing.assert_allclose(new, exp, rtol=0, atol=1e-5)


def test_a_surplus_agent_not_needed_is_not_counted_dropped_or_late(start_coordinator, agents, caplog):
    """QA: 'unmasked the sum of 20 agents (6 dropped after sharing keys)' and 'late 6' were the overselect surplus,
    agents that shared keys but whose update the round, at its target, did not wait for."""
    caplog.set_level("INFO", logger="fedpar")
    init = _weights()
    server = start_coordinator(init, **{**SECURE, "clients_per_round": 4, "overselect": 1.25}, deadline_seconds=20.0)
    bots = agents(server.address, IDS)
    locals_, errors = _run(server, bots, init, {"e": "before_upload"})  # e still trains when the target is reached
    assert not errors, errors
    row = server.coordinator.metrics.last
    assert (row["status"], row["sampled"], row["reported"], row["close_reason"]) == ("ok", 5, 4, "target reached")
    assert (row["late"], row["silent"], row["not_needed"]) == (0, 0, 1)
    assert (row["secagg_survivors"], row["secagg_dropped"], row["secagg_not_needed"]) == (4, 0, 1)
    assert any("unmasked the sum of 4 agents (0 dropped after sharing keys, 1 not needed: the target was reached "
               "first)" in r.getMessage() for r in caplog.records)
    for new, exp in zip(server.coordinator.weights, _fedavg(locals_, ["a", "b", "c", "d"])):
        np.testing.assert_allclose(new, exp, rtol=0, atol=1e-5)


def test_too_many_dropouts_fail_the_round_and_keep_the_model(start_coordinator, agents, caplog):
    caplog.set_level("WARNING", logger="fedpar")
    init = _weights()
    server = start_coordinator(init, **SECURE)
    bots = agents(server.address, IDS)
    _, errors = _run(server, bots, init, {"a": "after_upload", "b": "after_upload", "c": "after_upload"})
    assert not errors, errors
    row = server.coordinator.metrics.last
    assert row["status"] == "failed"
    assert "only 2 survivors sent unmask shares" in row["secagg_failure"]
    # the round failed for its secure aggregation, not for its 5 accepted updates (>= --min-reports 1)
    assert row["failure"] == f"secure aggregation failed: {row['secagg_failure']}"
    failed = [r.getMessage() for r in caplog.records if " failed: " in r.getMessage() and "global model" in r.getMessage()]
    assert failed == [f"round 1 failed: secure aggregation failed: {row['secagg_failure']}; global model unchanged"]
    for new, old in zip(server.coordinator.weights, init):
        assert new.tobytes() == old.tobytes()


def test_plain_uploads_and_malformed_stage_messages_are_refused(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, **{**SECURE, "secagg_stage_seconds": 1.0})
    bots = agents(server.address, IDS)
    bot = bots[0]
    task = bot.task()
    with pytest.raises(grpc.RpcError) as err:  # a plain model upload cannot enter a secure round
        bot.upload(task, init, 10, names=_names(init))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "shared its keys" in err.value.details()

    def call(**kw):
        base = dict(auth=bot.auth, round=task.round, task_id=task.task_id)
        return bot.stub.SecAggExchange(pb.SecAggRequest(**{**base, **kw}), timeout=10)

    bad = [(dict(stage=pb.SECAGG_SETUP, public_keys=pb.SecAggPublicKeys()), grpc.StatusCode.INVALID_ARGUMENT, "takes"),
           (dict(stage=pb.SECAGG_ADVERTISE, public_keys=pb.SecAggPublicKeys(c_public=b"x", s_public=b"y")),
            grpc.StatusCode.INVALID_ARGUMENT, "32 bytes"),
           (dict(stage=pb.SECAGG_ADVERTISE, public_keys=pb.SecAggPublicKeys(agent_id="b", c_public=bytes(32))),
            grpc.StatusCode.INVALID_ARGUMENT, "caller is 'a'"),
           (dict(stage=pb.SECAGG_SHARE, ciphertexts=pb.SecAggCiphertexts()), grpc.StatusCode.FAILED_PRECONDITION,
            "stage"),
           (dict(stage=pb.SECAGG_SETUP, task_id="forged"), grpc.StatusCode.FAILED_PRECONDITION, "not the current task"),
           (dict(stage=pb.SECAGG_SETUP, round=task.round + 1), grpc.StatusCode.FAILED_PRECONDITION, "current round")]
    for kw, code, text in bad:
        with pytest.raises(grpc.RpcError) as err:
            call(**kw)
        assert err.value.code() == code and text in err.value.details(), (kw, err.value.details())
    assert call(stage=pb.SECAGG_SETUP).WhichOneof("body") == "params_json"
    assert server.wait(30)  # nobody advertised: the round fails at the first stage, model unchanged
    row = server.coordinator.metrics.last
    assert row["status"] == "failed" and "advertised keys" in row["secagg_failure"]
    assert all(new.tobytes() == old.tobytes() for new, old in zip(server.coordinator.weights, init))


def test_secure_exchange_is_refused_when_not_enabled(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, clients_per_round=1, min_available=1)
    bot = agents(server.address, ["solo"])[0]
    task = bot.task()
    with pytest.raises(grpc.RpcError) as err:
        bot.stub.SecAggExchange(pb.SecAggRequest(auth=bot.auth, round=task.round, task_id=task.task_id), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--secure-aggregation" in err.value.details()
    assert bot.upload(task, init, 10).accepted


def test_a_cohort_too_small_to_mask_fails_the_round_cleanly(start_coordinator, agents):
    with pytest.raises(ValueError, match="clients_per_round >= 2"):
        start_coordinator(_weights(), secure_aggregation=True, clients_per_round=1, min_available=2)
    init = _weights()
    # fraction 0.2 of 2 live agents: K = 1, a cohort of one, whose update masking could not hide.
    server = start_coordinator(init, secure_aggregation=True, fraction=0.2, min_available=2, deadline_seconds=5.0)
    agents(server.address, ["p", "q"])
    assert server.wait(30)
    row = server.coordinator.metrics.last
    assert row["status"] == "failed" and "cannot set up secure aggregation for 1 agent: " in row["secagg_failure"]
    assert all(new.tobytes() == old.tobytes() for new, old in zip(server.coordinator.weights, init))


NORMS = {"a": 2.0, "b": 0.5, "c": 3.0, "d": 0.2, "e": 4.0}  # each agent's delta norm, in clip norms


def _play_private(bot, init, local, drop, errors):
    """One agent's secure round as client/secure_upload.SecureUpload plays it under client-side DP (clipped, weighing
    1, its clip bit after the update); ``drop`` as in :func:`_play`."""
    layout = ModelLayout.of_arrays(_names(init), init)
    task = bot.task()
    upload = SecureUpload(SecureSession(bot.stub, bot.auth, task, poll_seconds=1.0, stage_timeout=30.0), layout,
                          bot.max_chunk, lambda what, err: errors.append(f"{bot.agent_id}: {what}: {err}"))
    if not upload.begin():
        return
    global_weights = bot.download(task, layout)
    if drop == "before_upload" or not upload.upload(local, global_weights, None, {}, time.monotonic() + 30.0):
        return
    if drop != "after_upload":
        upload.close()


def test_client_dp_counts_the_clip_bits_of_the_survivors_only(start_coordinator, agents):
    """Client-side DP under secure aggregation, one clipped agent dropping before its upload and one after: the sum
    holds the four survivors' clipped updates and their bits only (2 of them clipped), and the coordinator's mean
    is the clear one's."""
    clip, init = 0.5, _weights()
    strategy = build_strategy("dp-fedavg", noise_multiplier=1e-9, clip_norm=clip, population=5, clients_per_round=5,
                              mode="client", seed=0)
    server = start_coordinator(init, strategy=strategy, **SECURE, deadline_seconds=5.0)
    bots = agents(server.address, IDS)
    rng = np.random.default_rng(1)
    deltas = {}
    for i in IDS:
        d = [rng.uniform(-1, 1, w.shape) for w in init]
        scale = NORMS[i] * clip / np.sqrt(sum(float(np.sum(x * x)) for x in d))
        deltas[i] = [x * scale for x in d]
    locals_ = {i: [(w + x).astype(np.float32) for w, x in zip(init, deltas[i])] for i in IDS}
    drops = {"c": "before_upload", "a": "after_upload"}
    errors: list[str] = []
    threads = [threading.Thread(target=_play_private, args=(b, init, locals_[b.agent_id], drops.get(b.agent_id),
                                                            errors)) for b in bots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert server.wait(60)
    assert not errors, errors
    row = server.coordinator.metrics.last
    assert (row["status"], row["reported"], row["num_updates"]) == ("ok", 4, 4) and "examples" not in row  # hidden
    assert (row["secagg_survivors"], row["secagg_dropped"]) == (4, 1)
    assert row["dp_clipped_fraction"] == 0.5  # a and e of a, b, d, e (c clipped too, but is not in the sum)
    survivors = ["a", "b", "d", "e"]
    for k, (new, g) in enumerate(zip(server.coordinator.weights, init)):
        clipped = sum(deltas[i][k] * min(1.0, 1 / NORMS[i]) for i in survivors)
        np.testing.assert_allclose(new, g + clipped / 5, rtol=0, atol=1e-5)  # the fixed denominator, 5


def test_a_clip_bit_that_does_not_add_up_fails_its_round_not_the_coordinator(start_coordinator, agents, monkeypatch):
    """QA: an agent masking a clip bit of -1 made the unmasked count -1 of 3, and DPStrategy.fold_secure_sum's
    ValueError stopped the coordinator with a traceback. The round fails (the model stays, no privacy is charged) and
    the next one runs."""
    init = _weights()
    strategy = build_strategy("dp-fedavg", noise_multiplier=1e-9, clip_norm=100.0, population=3,
                              clients_per_round=3, mode="client", seed=0)
    server = start_coordinator(init, strategy=strategy, **{**SECURE, "clients_per_round": 3, "min_available": 3},
                               rounds=2)
    bots = agents(server.address, IDS[:3])
    honest = SecureUpload._private_update

    def lying_in_round_1(self, trained, global_weights):
        vector = honest(self, trained, global_weights)
        if self.session.auth.agent_id == "a" and self.session.task.round == 1:
            vector[-1] = -self.session.client.params.bit_value
        return vector

    monkeypatch.setattr(SecureUpload, "_private_update", lying_in_round_1)
    errors: list[str] = []
    for round_id in (1, 2):  # the agents play round 1, then round 2
        threads = [threading.Thread(target=_play_private, args=(b, init, _local(init, i + 1), None, errors))
                   for i, b in enumerate(bots)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, (round_id, errors)
    assert server.wait(60)
    first, second = server.coordinator.metrics.read_rows()
    assert first["status"] == "failed" and "dp_epsilon" not in first
    assert first["secagg_failure"] == ("the unmasked sum was refused: the secure sum counts -1.000 clipped updates "
                                       "of 3: an agent masked a clip bit other than 0 or 1, or the masks were not "
                                       "removed right")
    assert second["status"] == "ok" and second["dp_clipped_fraction"] == 0.0 and second["dp_epsilon"] > 0
