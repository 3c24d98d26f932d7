"""Client-batched training computes what each client's LocalTrainer computes alone: per step and per round."""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedpar import ClientData, Partition, Task
from fedpar.client.batched_trainer import (ClientBatch, ClientBatchInput, batching_refusal, check_batchable,
                                           train_clients_batched)
from fedpar.client.task_trainer import TaskTrainer
from fedpar.client.local_loop import shuffling_generator, stacked_schedules
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import ArrayDataset, load_dataset
from fedpar.models.for_data import build_model_for_data

# Different example counts: partial last batches (23, 37 and 7 are not multiples of BATCH), one client that
# runs out of steps first (7 examples: one step per epoch) and one whose counts divide evenly (40).
SIZES, BATCH, EPOCHS, LR, ROUND = (23, 40, 7, 37), 8, 2, 0.1, 3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _exact_float32_one_thread():
    """TF32 off (it only matters on CUDA): the comparisons are float32 against float32. One CPU thread: these
    small steps only lose time to a second thread on a shared machine."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_num_threads()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, threads = before
    torch.set_num_threads(threads)


def _setup(model_name: str):
    """A digits model and one ArrayDataset per client, of SIZES examples each."""
    splits = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model_for_data(model_name, splits.input_shape, splits.num_classes)
    offsets = np.cumsum((0,) + SIZES)
    data = [splits.train.subset(np.arange(a, b)) for a, b in zip(offsets[:-1], offsets[1:])]
    return model, data


def _inputs(data: list[ArrayDataset]) -> list[ClientBatchInput]:
    return [ClientBatchInput(*d.to_tensors(), seed=10 + k) for k, d in enumerate(data)]


def _local_batches(n: int, seed: int) -> list[torch.Tensor]:
    """The index batches LocalTrainer.train draws (written out again here, independently of member_batches)."""
    gen = shuffling_generator(seed, ROUND)
    batches = []
    for _ in range(EPOCHS):
        order = torch.randperm(n, generator=gen)
        batches += [order[b:b + BATCH] for b in range(0, n, BATCH)]
    return batches


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_name, mu", [("mlp", 0.0), ("mlp", 0.5), ("cnn", 0.0)])
def test_batched_gradients_equal_each_clients_own_gradients_at_every_step(model_name, mu, device):
    model, data = _setup(model_name)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = ClientBatch(model, _inputs(data), EPOCHS, BATCH, LR, ROUND, device, proximal_mu=mu)
    plans = [_local_batches(len(d), 10 + k) for k, d in enumerate(data)]
    deadline_stop = (0, 3)  # client 0 is stopped (as by its deadline) after its first epoch (8 + 8 + 7)
    reference = copy.deepcopy(model).to(device)
    worst, steps_seen = 0.0, [0] * len(data)
    while batch.active():
        s = batch.step_index
        if s == deadline_stop[1] and deadline_stop[0] in batch.active():
            frozen = batch.client_weights(deadline_stop[0])
            batch.leave([deadline_stop[0]])
        assert batch.active() == [k for k, p in enumerate(plans) if s < len(p) and not (k == 0 and s >= 3)]
        grads, losses = batch.gradients()
        for row, k in enumerate(batch.active()):
            x, y = (t.to(device) for t in data[k].to_tensors())
            idx = plans[k][s].to(device)
            now = batch.client_weights(k)
            with torch.no_grad():
                for n, p in reference.named_parameters():
                    p.copy_(now[n])
            reference.zero_grad(set_to_none=True)
            loss = F.cross_entropy(reference(x[idx]), y[idx])
            objective = loss + 0.5 * mu * sum((p - start[n].to(device)).pow(2).sum()
                                              for n, p in reference.named_parameters())
            objective.backward()
            assert abs(losses[row].item() - loss.item()) <= 1e-6 * abs(loss.item())
            for n, p in reference.named_parameters():
                worst = max(worst, _relative_error(grads[n][row], p.grad))
            steps_seen[k] += 1
        batch.step()
    assert worst <= 1e-5, worst
    assert steps_seen == [3, len(plans[1]), len(plans[2]), len(plans[3])]
    assert len(plans[2]) == EPOCHS < len(plans[1])  # the small client left the batch early
    # The stopped client's weights froze when it left; the others' results count what they trained on.
    out = batch.outputs(seconds=0.0)
    assert all(torch.equal(out[0].weights[n], frozen[n].cpu()) for n in frozen)
    assert [o.result.stopped_early for o in out] == [True, False, False, False]
    assert [o.result.steps for o in out] == steps_seen
    assert out[0].result.examples == SIZES[0] and out[1].result.examples == EPOCHS * SIZES[1]


@pytest.mark.parametrize("model_name, mu", [("mlp", 0.0), ("mlp", 0.3), ("cnn", 0.0)])
def test_a_batched_round_ends_where_each_local_trainer_ends(model_name, mu):
    model, data = _setup(model_name)
    before = [p.detach().clone() for p in model.parameters()]
    outputs = train_clients_batched(model, _inputs(data), EPOCHS + 1, BATCH, LR, ROUND, proximal_mu=mu)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the template is not trained
    for k, (d, out) in enumerate(zip(data, outputs)):
        alone = copy.deepcopy(model)
        want = LocalTrainer(alone, d, seed=10 + k).train(EPOCHS + 1, BATCH, LR, proximal_mu=mu, round_id=ROUND)
        got = out.result
        assert (got.steps, got.examples, got.stopped_early) == (want.steps, want.examples, False)
        assert got.loss == pytest.approx(want.loss, rel=1e-6)
        for n, p in alone.named_parameters():
            # Measured on this CPU: at most 2.2e-7 of the tensor's largest weight after 3 epochs (loss: 7e-8).
            assert (out.weights[n] - p.detach()).abs().max() <= 2e-6 * p.detach().abs().max(), n


def test_a_tasks_loss_and_optimizer_step_each_stacked_member_as_its_own_loop_does():
    # Members leave the stack at different steps (7 examples: one step an epoch), so the optimizer's state (the
    # momentum buffers) moves with them. SGD with momentum, not Adam: Adam's first steps move a weight by about lr
    # whatever the size of its gradient, so the rounding in gradients of about 1e-12 (dead units) shows as 1e-3.
    model, data = _setup("cnn")
    task = Task(model=lambda: copy.deepcopy(model), client_data=lambda p: ClientData(data[p.index]),
                loss=F.cross_entropy,
                optimizer=lambda params, lr: torch.optim.SGD(params, lr, momentum=0.9, weight_decay=1e-3))
    assert batching_refusal(task) is None
    outputs = train_clients_batched(model, _inputs(data), EPOCHS + 1, BATCH, LR, ROUND, loss=task.loss,
                                    optimizer=task.optimizer)
    for k, out in enumerate(outputs):
        alone = TaskTrainer(task, task.client_data(Partition(k, len(data))), seed=10 + k)
        want = alone.train(EPOCHS + 1, BATCH, LR, round_id=ROUND)
        assert (out.result.steps, out.result.examples) == (want.steps, want.examples)
        assert out.result.loss == pytest.approx(want.loss, rel=1e-6)
        for n, p in alone.model.named_parameters():
            # Measured: at most 2.1e-7 of the tensor's largest weight.
            assert (out.weights[n] - p.detach()).abs().max() <= 2e-6 * p.detach().abs().max(), n


def test_what_cannot_stack_is_refused_with_the_reason():
    task = Task(model=lambda: nn.Linear(3, 2), client_data=lambda p: None, loss=F.cross_entropy)
    assert batching_refusal(task) is None
    hooked = Task(model=task.model, client_data=task.client_data, train=lambda *a: (0, {}), name="hooked")
    assert "trains with its own train hook" in batching_refusal(hooked)
    lbfgs = Task(model=task.model, client_data=task.client_data, loss=F.cross_entropy,
                 optimizer=lambda params, lr: torch.optim.LBFGS(params, lr))
    assert "optimizer of task 'task' is a LBFGS" in batching_refusal(lbfgs)
    # It said "task 'adafactor''s optimizer is a Adafactor": a quote glitch and the wrong article (QA)
    adafactor = Task(model=task.model, client_data=task.client_data, loss=F.cross_entropy, name="drop_task.py:task",
                     optimizer=lambda params, lr: torch.optim.Adafactor(params, lr))
    assert batching_refusal(adafactor).startswith("the optimizer of task 'drop_task.py:task' is an Adafactor; client "
                                                  "batching steps")


def test_deadlines_stop_each_client_on_its_own_clock():
    model, data = _setup("mlp")
    now = time.monotonic()
    clients = _inputs(data)
    clients[0].stop_at = now - 1.0  # no time left: no step at all
    clients[1].stop_at, clients[1].step_delay = now + 0.3, 0.02  # a slow device: about 15 of its 30 steps fit
    outputs = train_clients_batched(model, clients, 6, BATCH, LR, ROUND)
    assert (outputs[0].result.steps, outputs[0].result.examples, outputs[0].result.stopped_early) == (0, 0, True)
    assert math.isnan(outputs[0].result.loss)
    assert all(torch.equal(outputs[0].weights[n], p.detach()) for n, p in model.named_parameters())
    slow = outputs[1].result
    assert slow.stopped_early and 5 <= slow.steps <= 15 and slow.examples == slow.steps * BATCH  # 40 = 5 batches
    assert slow.seconds >= slow.steps * 0.02
    for k in (2, 3):  # no deadline: every step of every epoch
        assert not outputs[k].result.stopped_early
        assert outputs[k].result.examples == 6 * SIZES[k]


def test_models_with_random_or_stateful_layers_are_refused():
    check_batchable(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.0)))  # p=0 draws nothing: allowed
    for layer in (nn.Dropout(0.5), nn.BatchNorm1d(3)):
        with pytest.raises(ValueError, match="without batch-norm statistics or dropout"):
            check_batchable(nn.Sequential(nn.Linear(3, 3), layer))


def test_a_stacks_trained_members_come_out_as_one_tensor_per_weight_with_their_examples():
    # What a host's pre-summed upload can fold in one tensor op: row k of each stacked weight is member k's trained
    # weight (its output's weights are views of it) and examples[k] the examples it trained on.
    model, data = _setup("mlp")
    outputs = train_clients_batched(model, _inputs(data), EPOCHS, BATCH, LR, ROUND)
    stack = outputs[0].stack
    assert all(out.stack is stack and out.row == k for k, out in enumerate(outputs))
    assert stack.examples.tolist() == [EPOCHS * n for n in SIZES]
    for name, p in model.named_parameters():
        assert stack.params[name].shape == (len(SIZES), *p.shape)
        for k, out in enumerate(outputs):
            assert out.weights[name].data_ptr() == stack.params[name][k].data_ptr()  # a view, not a copy


def test_a_batch_above_every_members_size_is_each_members_whole_epoch_padded_to_the_largest():
    """--batch-size 1000000 padded every member's epoch to a million slots: 19 GiB and 50x slower (QA)."""
    sizes, seeds = [23, 40, 7], [3, 4, 5]
    huge = stacked_schedules(sizes, seeds, EPOCHS, 1_000_000, ROUND)
    assert huge[0].shape == (3, EPOCHS, 40)  # each epoch one batch, as wide as the largest member
    same = stacked_schedules(sizes, seeds, EPOCHS, 40, ROUND)
    assert torch.equal(huge[0], same[0]) and torch.equal(huge[1], same[1])


def test_the_stacked_schedules_are_each_members_own_batches():
    sizes, seeds = [23, 40, 7, 37, 16], [3, 4, 5, 6, 7]
    index, mask = stacked_schedules(sizes, seeds, EPOCHS, BATCH, ROUND)
    first = 0
    for k, n in enumerate(sizes):
        own = _local_batches(n, seeds[k])
        steps = len(own)
        for step, batch in enumerate(own):  # its real examples first, then the padding
            assert mask[k, step].tolist() == [True] * len(batch) + [False] * (BATCH - len(batch))
            assert torch.equal(index[k, step, :len(batch)], batch + first)
        assert not mask[k, steps:].any()
        assert ((index[k][~mask[k]] >= first) & (index[k][~mask[k]] < first + n)).all()  # padding stays its own
        first += n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("model_name, sizes", [("cnn", (40, 40, 40)), ("mlp", SIZES)])
def test_steps_replayed_as_a_cuda_graph_train_as_the_eager_steps_do(model_name, sizes):
    model, _ = _setup(model_name)
    splits = load_dataset("digits")
    offsets = np.cumsum((0,) + sizes)
    data = [splits.train.subset(np.arange(a, b)) for a, b in zip(offsets[:-1], offsets[1:])]
    runs = {}
    for graphs in (True, False):
        batch = ClientBatch(model, _inputs(data), 6, BATCH, LR, ROUND, "cuda", cuda_graphs=graphs)
        while batch.active():
            if batch.step_index == 9 and 1 in batch.active():
                batch.leave([1])  # a deadline mid-stack: the others' graph is recorded again without it
            batch.step()
        runs[graphs] = batch.graph_steps, batch.outputs(seconds=0.0)
    (graph_steps, graphed), (eager_steps, eager) = runs[True], runs[False]
    assert eager_steps == 0 and graph_steps >= 10, graph_steps
    for a, b in zip(graphed, eager):
        assert (a.result.steps, a.result.examples, a.result.stopped_early) == \
               (b.result.steps, b.result.examples, b.result.stopped_early)
        assert a.result.loss == pytest.approx(b.result.loss, rel=1e-5)
        for n in a.weights:
            assert (a.weights[n] - b.weights[n]).abs().max() <= 1e-5 * b.weights[n].abs().max(), n
