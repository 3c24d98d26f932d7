"""Client-side DP over real gRPC: the clip norm reaches agents, they clip, a lying agent is refused."""

from __future__ import annotations

import json
import threading

import grpc
import numpy as np
import pytest
import torch

from fedpar.aggregation import build_strategy
from fedpar.aggregation.clipping import delta_norm
from fedpar.cli.privacy import privacy_strategy
from fedpar.cli.main import build_parser
from fedpar.client.transfer import dp_settings, privatize_update
from fedpar.datasets import load_dataset
from fedpar.models import get_weights, weight_specs
from fedpar.models.for_data import build_model_for_data
from fedpar.protocol.codec import ModelLayout
from fedpar.server.checkpoint import load_checkpoint
from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.local_loop import member_seed
from fedpar.client.task_trainer import TaskTrainer
from fedpar.task import Partition
from fedpar.tasks.zoo import classifier_for


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((20, 30), (30,))]


def _run_real_agents(server, splits, k: int) -> list:
    """k real agents (MLP, at most 600 // k digits each), each in a thread named after it, until the run ends."""
    task = classifier_for("mlp", splits, examples_per_client=600 // k)
    bots = []
    for i in range(k):
        agent_id = f"agent-{i}"
        torch.manual_seed(0)
        trainer = TaskTrainer(task, task.client_data(Partition(i, k, agent_id, "iid", 0, 0.0)),
                              seed=member_seed(0, agent_id))
        bots.append(Agent(AgentConfig(server=server.address, agent_id=agent_id, poll_seconds=1.0, give_up_after=60.0,
                                      insecure=True, seed=i), trainer))
    threads = [threading.Thread(target=bot.run, name=bot.config.agent_id) for bot in bots]
    for t in threads:
        t.start()
    assert server.wait(90)
    for t in threads:
        t.join(timeout=30)
    return bots


@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")
def test_client_dp_refuses_an_unclipped_update_and_completes_the_round(start_coordinator, agents, tmp_path):
    init = _weights()
    strategy = build_strategy("dp-fedavg", noise_multiplier=1e-6, clip_norm=0.5, population=3,
                              clients_per_round=3, mode="client", seed=0)
    server = start_coordinator(init, strategy=strategy, clients_per_round=3, min_available=3,
                               checkpoint_dir=tmp_path / "ckpt")
    honest_a, liar, honest_b = agents(server.address, ["a", "liar", "b"])
    layout = ModelLayout.of_arrays([f"t{i}" for i in range(len(init))], init)
    sent = []
    for bot, seed in ((honest_a, 1), (liar, 2), (honest_b, 3)):
        task = bot.task()
        extra = json.loads(task.extra_json)
        assert extra == {"dp_clip_norm": 0.5, "dp_local_noise": 0.0}
        glob = bot.download(task, layout)
        trained = _weights(seed)  # far from the global model: delta norm ~ 35
        if bot is liar:
            with pytest.raises(grpc.RpcError) as err:
                bot.upload(task, trained, 100)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "clip norm" in err.value.details()
            continue
        update, clipped = privatize_update(trained, glob, dp_settings(extra))
        assert clipped
        assert delta_norm(update, glob) == pytest.approx(0.5, rel=1e-5)
        assert bot.upload(task, update, 100).accepted
        sent.append(update)
    assert server.wait(30)
    row = server.coordinator.metrics.last
    assert (row["status"], row["reported"], row["rejected"]) == ("ok", 2, 1)
    assert row["dp_epsilon"] > 0 and row["dp_clip_norm"] == 0.5 and row["num_updates"] == 2.0
    # fixed denominator 3: the global model moved by (delta_a + delta_b) / 3, nothing of the liar's
    for i, new in enumerate(server.coordinator.weights):
        expected = init[i] + ((sent[0][i] - init[i]) + (sent[1][i] - init[i])) / 3
        np.testing.assert_allclose(new, expected, atol=1e-5)
    # the privacy history is checkpointed (JSON) and a restarted coordinator's accountant continues from it
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.state["strategy"]["accountant"]["history"] == [[1e-6, 1.0, 1]]
    server.stop()
    fresh = build_strategy("dp-fedavg", noise_multiplier=1e-6, clip_norm=0.5, population=3,
                           clients_per_round=3, mode="client")
    start_coordinator(init, strategy=fresh, rounds=2, clients_per_round=3, min_available=3,
                      checkpoint_dir=tmp_path / "ckpt")
    assert fresh.accountant.steps == 1 and fresh.accountant.epsilon() == pytest.approx(row["dp_epsilon"])


@pytest.mark.timeout(120)
def test_real_agents_clip_to_the_adaptive_clip_norm_and_none_is_refused(start_coordinator):
    """Real Agent + LocalTrainer objects (threads in this process) train on digits under client-side DP."""
    splits = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
    names = [n for n, _, _ in weight_specs(model)]
    strategy = build_strategy("dp-fedavg", noise_multiplier=0.3, clip_norm=0.05, population=3,
                              clients_per_round=3, mode="client", target_quantile=0.5, count_noise=0.5,
                              seed=0)
    server = start_coordinator(get_weights(model), names=names, strategy=strategy, rounds=3,
                               clients_per_round=3, min_available=3, local_epochs=1, learning_rate=0.1)
    bots = _run_real_agents(server, splits, 3)
    rows = list(server.coordinator.metrics.read_rows())
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert all(r["reported"] == 3 and r["rejected"] == 0 for r in rows)  # every agent clipped as asked
    assert rows[0]["dp_clip_norm"] == 0.05 and rows[0]["dp_clipped_fraction"] == 1.0  # one epoch moves > 0.05
    assert rows[1]["dp_clip_norm"] > 0.05  # all clipped: the clip norm grows toward the median norm
    assert all(b.stats.accepted == 3 and not b.stats.refusals for b in bots)


def _clipped_delta(update, reference, clip):
    """``update - reference`` over the whole model, flat, scaled down to L2 norm ``clip`` if longer (float64)."""
    delta = np.concatenate([(np.asarray(u, np.float64) - r).ravel() for u, r in zip(update, reference)])
    return delta * min(1.0, clip / np.linalg.norm(delta))


def _flat(arrays):
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")
@pytest.mark.parametrize("clip, local_noise, central_noise, coordinator_clips",
                         [(0.5, 0.005, 0.1, False), (0.05, 1.0, 1.0, True)],
                         ids=["noisy-update-within-clip", "noisy-update-beyond-clip"])
def test_real_agents_add_local_noise_and_the_coordinator_clips_what_arrives(start_coordinator, monkeypatch, clip,
                                                                          local_noise, central_noise,
                                                                          coordinator_clips):
    """Real agents under `--privacy client --privacy-local-noise s`: the coordinator folds their noisy uploads,
    clipped to C.

    An MLP update after one epoch has norm ~0.12. Case one: C = 0.5 and local noise of norm ~0.25, so neither
    agent nor coordinator clips and the model carries the local noise itself. Case two: C = 0.05 (agents clip)
    and local noise of norm ~100 C, so the coordinator scales every upload back to norm C.
    """
    rounds, k = 2, 3
    args = build_parser().parse_args(["serve", "--privacy", "client", "--privacy-clip", str(clip), "--privacy-noise",
                                      str(central_noise), "--privacy-local-noise", str(local_noise)])
    name, options = privacy_strategy(args, "fedavg", clients_per_round=k, overselect=1.0, population=k)
    strategy = build_strategy(name, **options, seed=0)  # seeded central noise, replayed below
    uploads = []  # (agent, round, global, trained, uploaded), as the agents' own privatize_update saw them
    calls: dict[str, int] = {}

    def seeded_privatize(new, glob, dp, rng=None):
        agent = threading.current_thread().name
        calls[agent] = round_id = calls.get(agent, 0) + 1
        assert dp == (clip, local_noise)
        out, clipped = privatize_update(new, glob, dp, rng=np.random.default_rng([int(agent[-1]), round_id]))
        uploads.append((agent, round_id, [g.copy() for g in glob], [w.copy() for w in new], [o.copy() for o in out]))
        return out, clipped

    monkeypatch.setattr("fedpar.client.transfer.privatize_update", seeded_privatize)
    splits = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
    names = [n for n, _, _ in weight_specs(model)]
    server = start_coordinator(get_weights(model), names=names, strategy=strategy, rounds=rounds,
                               clients_per_round=k, min_available=k, local_epochs=1, learning_rate=0.05)
    bots = _run_real_agents(server, splits, k)
    rows = list(server.coordinator.metrics.read_rows())
    assert [(r["status"], r["reported"], r["rejected"]) for r in rows] == [("ok", k, 0)] * rounds
    assert all(b.stats.accepted == rounds and not b.stats.refusals for b in bots)
    assert len(uploads) == k * rounds

    # Replay each round through a fresh DP strategy with the same seed, fed the agents' updates *before* their
    # local noise: the noise-free model, with the very same central noise draw as the coordinator's.
    replay = build_strategy(name, **options, seed=0)
    d = sum(w.size for w in get_weights(model))
    for round_id, row in enumerate(rows, 1):
        mine = [u for u in uploads if u[1] == round_id]
        glob = mine[0][2]
        assert all(_flat(u[2]).tobytes() == _flat(glob).tobytes() for u in mine)
        new = server.coordinator.weights if round_id == rounds else [u for u in uploads if u[1] == round_id + 1][0][2]
        replay.begin_round(round_id, glob)
        clean_deltas, local_noises, folded = [], [], []
        for agent, _, g, trained, uploaded in mine:
            clean, _ = privatize_update(trained, g, (clip, 0.0))  # the agent's clip, no noise
            replay.fold(clean, 1, agent)
            noise = _flat(uploaded) - _flat(clean)
            # The agent added N(0, (s C)^2) to each of the d coordinates (std within ~7 standard errors).
            assert noise.std() == pytest.approx(local_noise * clip, rel=0.05)
            assert abs(noise.mean()) < 5 * local_noise * clip / np.sqrt(d)
            clean_deltas.append(_clipped_delta(clean, g, clip))
            local_noises.append(noise)
            folded.append(_clipped_delta(uploaded, g, clip))  # what the coordinator should have folded
        noise_free, replay_metrics = replay.finish()
        # The coordinator folded each noisy upload clipped to C: its model is the noise-free one plus the
        # mean over agents of (clipped noisy delta - clean delta), to float32 rounding.
        moved = _flat(new) - _flat(noise_free)
        np.testing.assert_allclose(moved, sum(f - c for f, c in zip(folded, clean_deltas)) / k, rtol=0, atol=2e-6)
        if not coordinator_clips:  # local noise of norm s C sqrt(d) ~ C / 2 kept every upload within C
            assert row["dp_clipped_fraction"] == 0.0
            assert all(np.linalg.norm(c) < clip / 2 for c in clean_deltas)  # the agents did not clip either
            np.testing.assert_allclose(moved, sum(local_noises) / k, rtol=0, atol=2e-6)
            # the mean of k independent local noises: per-coordinate std s C / sqrt(k)
            assert moved.std() == pytest.approx(local_noise * clip / np.sqrt(k), rel=0.05)
        else:  # local noise of norm ~ 100 C put every upload far beyond C: the coordinator scaled it back to C
            assert row["dp_clipped_fraction"] == 1.0
            assert all(np.linalg.norm(n) > 50 * clip for n in local_noises)
            assert all(np.linalg.norm(c) == pytest.approx(clip, rel=1e-5) for c in clean_deltas)  # agents clipped
            # each agent moves the model by at most 2C from its noise-free place; unclipped local noise alone
            # would have moved it by about s C sqrt(d / k), ~ 57 C here
            assert np.linalg.norm(moved) <= 2 * clip
        # Central noise on top: std z C / k per coordinate, and epsilon as the accountant charges z, q = 1.
        assert row["dp_noise_std"] == pytest.approx(central_noise * clip / k)
        assert row["dp_sample_rate"] == 1.0
        assert row["dp_epsilon"] == pytest.approx(replay_metrics["dp_epsilon"]) and row["dp_epsilon"] > 0
    assert rows[1]["dp_epsilon"] > rows[0]["dp_epsilon"]
