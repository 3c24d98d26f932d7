"""fedpar.Task in an agent's trainer: the built-in loop with the task's loss, optimizer and loader, a task's own
train hook, named metrics, the deadline, and the zoo as a task (the same numbers as LocalTrainer)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from fedpar import ClientData, Deadline, Partition, Task, TaskError
from fedpar.client.task_trainer import TaskTrainer
from fedpar.client.trainer import LocalTrainer
from fedpar.models import get_weights, weight_specs
from fedpar.server.coordinator import _weighted_client_metrics
from fedpar.tasks import share_of
from fedpar.tasks.zoo import classifier, language_model


class Regression(Dataset):
    """A map-style dataset that is not in memory as tensors: the built-in loop batches it with a DataLoader."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def _mae(model: nn.Module, data) -> dict[str, float]:
    x, y = data.x, data.y
    out = model(x).squeeze(1)
    return {"loss": float(((out - y) ** 2).mean()), "mae": float((out - y).abs().mean())}


def _regression_task(**hooks) -> Task:
    return Task(model=lambda: nn.Linear(3, 1), client_data=lambda p: ClientData(Regression(64), Regression(32, 1)),
                loss=lambda out, y: nn.functional.mse_loss(out.squeeze(1), y), evaluate=_mae, **hooks)


def test_builtin_loop_uses_the_tasks_optimizer_and_dataloader_and_reports_named_metrics():
    task = _regression_task(optimizer=lambda params, lr: torch.optim.Adam(params, lr))
    trainer = TaskTrainer(task, task.client_data(Partition()))
    specs = weight_specs(trainer.model)
    before = trainer.evaluate()
    result = trainer.train(epochs=20, batch_size=8, lr=0.05)
    after = trainer.evaluate()
    assert (result.steps, result.examples) == (20 * 8, 20 * 64) and not result.stopped_early
    assert after.metrics["mae"] < before.metrics["mae"] / 2 and after.accuracy is None
    assert set(after.as_metrics()) == {"eval_loss", "eval_mae", "eval_examples"}  # no accuracy of a regression
    assert weight_specs(trainer.model) == specs  # the layout the coordinator expects, unchanged


def test_builtin_loop_stops_before_the_deadline():
    task = _regression_task()
    trainer = TaskTrainer(task, task.client_data(Partition()), seconds_per_step_delay=0.01)
    stop_at = time.monotonic() + 0.3
    result = trainer.train(epochs=1000, batch_size=4, lr=0.01, stop_at=stop_at)
    assert time.monotonic() <= stop_at + 0.05 and result.stopped_early and 0 < result.steps < 1000 * 16


def test_a_tasks_own_train_hook_gets_config_and_deadline_and_its_metrics_travel():
    seen = {}

    def train(model, data, config, deadline):
        seen.update(epochs=config.epochs, lr=config.learning_rate, round=config.round, left=deadline.remaining())
        opt = torch.optim.SGD(model.parameters(), config.learning_rate)
        examples = 0
        for x, y in deadline.steps(torch.utils.data.DataLoader(data.train, batch_size=16)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
            examples += len(y)
        return examples, {"seen_batches": deadline.taken}

    task = _regression_task(train=train)
    trainer = TaskTrainer(task, task.client_data(Partition()))
    result = trainer.train(epochs=3, batch_size=16, lr=0.1, stop_at=time.monotonic() + 30, round_id=4)
    assert seen["epochs"] == 3 and seen["lr"] == 0.1 and seen["round"] == 4 and 0 < seen["left"] <= 30
    assert (result.examples, result.steps) == (64, 4) and math.isnan(result.loss)
    assert result.as_metrics().keys() == {"train_seen_batches", "train_seconds"}  # no loss reported: none sent
    # The coordinator averages every named metric by examples (train_*) or validation examples (eval_*).
    row = _weighted_client_metrics([(10, {"train_seen_batches": 4.0, "eval_mae": 1.0, "eval_examples": 1.0}),
                                    (30, {"train_seen_batches": 8.0, "eval_mae": 3.0, "eval_examples": 3.0})])
    assert row == {"train_seen_batches": 7.0, "federated_eval_mae": 2.5}


def test_deadline_steps_stop_an_endless_loop_in_time():
    deadline = Deadline(time.monotonic() + 0.2)
    for _ in deadline.steps(iter(int, 1)):  # endless
        time.sleep(0.01)
    assert deadline.stopped_early and deadline.remaining() > -0.03 and deadline.taken > 5


@pytest.mark.parametrize("result, message", [
    ("oops", r"train must return \(examples, metrics\)"),
    ((-1, {}), "whole number of examples >= 0"),
    ((3, {"bad name": 1.0}), "metric name 'bad name'"),
    ((3, {"acc": "high"}), "metric 'acc' must be a number"),
])
def test_a_train_hook_returning_the_wrong_thing_is_named(result, message):
    task = _regression_task(train=lambda *a: result)
    with pytest.raises(TaskError, match=message):
        TaskTrainer(task, task.client_data(Partition())).train(1, 8, 0.1)


def test_a_task_without_a_loss_or_a_train_hook_says_what_is_missing():
    with pytest.raises(TaskError, match="needs a loss.*or its own train.*needs an evaluate"):
        Task(model=lambda: nn.Linear(1, 1), client_data=lambda p: None, name="bare").check()


def test_the_zoo_classifier_task_trains_as_local_trainer_does():
    task = classifier("mlp", "digits")
    data = task.client_data(Partition(1, 4, "b", "iid", 0, 0.1))
    torch.manual_seed(0)
    ours = TaskTrainer(task, data, seed=7)
    torch.manual_seed(0)
    theirs = LocalTrainer(task.model(), data.train, data.val, seed=7)
    a, b = ours.train(2, 16, 0.1, round_id=3), theirs.train(2, 16, 0.1, round_id=3)
    assert (a.steps, a.examples) == (b.steps, b.examples) and a.loss == pytest.approx(b.loss, rel=1e-5)
    for x, y in zip(get_weights(ours.model), get_weights(theirs.model)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    assert ours.evaluate().as_metrics() == pytest.approx(theirs.evaluate().as_metrics())


def test_share_of_splits_a_dataset_among_clients_with_validation_shares():
    data = Regression(100)
    shares = [share_of(data, Partition(i, 4, val_fraction=0.2)) for i in range(4)]
    assert [(len(s.train), len(s.val)) for s in shares] == [(20, 5)] * 4
    seen = {float(x[0]) for s in shares for part in (s.train, s.val) for x, _ in part}
    assert len(seen) == 100  # every example once
    with pytest.raises(TaskError, match="needs integer class labels"):
        share_of(data, Partition(0, 2, scheme="dirichlet:0.5"))


def test_the_zoo_gpt_is_a_task_on_a_text_file(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    task = language_model(str(text), block_size=16, n_layer=1, n_head=2, d_model=16)
    trainer = TaskTrainer(task, task.client_data(Partition(0, 2, val_fraction=0.2)))
    result = trainer.train(1, 4, 0.1)
    assert result.steps == math.ceil(trainer.num_examples / 4) and math.isfinite(result.loss)
    assert set(trainer.evaluate().as_metrics()) == {"eval_loss", "eval_examples"}  # token scores: no accuracy


def test_the_engines_batch_of_given_examples_is_what_the_built_in_loop_would_batch():
    from torch.utils.data import TensorDataset

    from fedpar.tasks.data import batch_at

    slow = Regression(10)
    fast = TensorDataset(slow.x, slow.y)
    picked = [7, 2, 5]
    for dataset in (slow, fast):  # by a DataLoader, and by indexing the tensors
        x, y = batch_at(dataset, picked)
        assert torch.equal(x, slow.x[picked]) and torch.equal(y, slow.y[picked])

    def doubled(dataset, batch_size, generator):  # a task's own loader collates the examples it is given
        yield from ((x * 2, y) for x, y in torch.utils.data.DataLoader(dataset, batch_size=batch_size))

    x, y = batch_at(fast, picked, doubled)
    assert torch.equal(x, 2 * slow.x[picked]) and torch.equal(y, slow.y[picked])


def _dropout_task() -> Task:
    return Task(model=lambda: nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.5), nn.Linear(16, 1)),
                client_data=lambda p: ClientData(Regression(64, p.index), Regression(16, 9)),
                loss=lambda out, y: nn.functional.mse_loss(out.squeeze(1), y), evaluate=_mae)


def _trained(trainer: TaskTrainer, start: list[np.ndarray], member: int, seed: int, round_id: int,
             delay: float = 0.0) -> list[np.ndarray]:
    task = _dropout_task()
    trainer.use_data(task.client_data(Partition(member, 4, f"m{member}")), seed, delay)
    trainer.set_arrays(start)
    trainer.train(epochs=2, batch_size=8, lr=0.05, round_id=round_id)
    return trainer.get_arrays()


def test_a_members_dropout_draws_are_its_own_whatever_its_seat_or_process_drew_before():
    """A model's dropout drew from torch's process-wide stream, so a simulated member's mask depended on the members
    its seat (and the other seats) trained before it, and on nothing a deployed agent of its id could match. Each
    member now draws from its own stream of the round (client/local_loop.member_draws), also across the pauses of a
    slow device, in which another seat trains."""
    import threading

    torch.manual_seed(0)
    start = TaskTrainer(_dropout_task(), _dropout_task().client_data(Partition(0, 4, "m0"))).get_arrays()
    alone = _trained(TaskTrainer(_dropout_task(), _dropout_task().client_data(Partition(0, 4, "m0"))), start, 1, 11, 3)
    seat = TaskTrainer(_dropout_task(), _dropout_task().client_data(Partition(0, 4, "m0")))
    _trained(seat, start, 2, 12, 3)  # another member first, and other draws of this process's
    torch.rand(7)
    after_others = _trained(seat, start, 1, 11, 3)
    for got, want in zip(after_others, alone):
        np.testing.assert_array_equal(got, want)
    other_round = _trained(seat, start, 1, 11, 4)
    assert any(not np.array_equal(a, b) for a, b in zip(other_round, alone))  # a new round, new masks

    turn = threading.Lock()  # two slow seats that take turns, each pausing after every step
    seats = [TaskTrainer(_dropout_task(), _dropout_task().client_data(Partition(0, 4, "m0")), compute_lock=turn)
             for _ in range(2)]
    got: dict[int, list[np.ndarray]] = {}
    threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, _trained(seats[k], start, k + 1, 11 + k, 3,
                                                                                   delay=0.002)))
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want_2 = _trained(TaskTrainer(_dropout_task(), _dropout_task().client_data(Partition(0, 4, "m0"))), start, 2, 12, 3)
    for member, want in ((0, alone), (1, want_2)):
        for a, b in zip(got[member], want):
            np.testing.assert_array_equal(a, b)


def test_weights_a_train_hook_put_in_new_tensors_are_what_the_trainer_uploads_and_loads_next():
    """The trainer lists a hook task's tensors once a run, after the hook (not at every get and set): a hook that
    swaps a parameter for a new one of the same shape must still be read, and loaded into, from then on."""
    def swap(model, data, config, deadline):
        model.weight = nn.Parameter(torch.full_like(model.weight, 7.0))
        return len(data.train), {}

    trainer = TaskTrainer(_regression_task(train=swap), ClientData(Regression(16), None))
    trainer.set_arrays([np.zeros((1, 3), np.float32), np.zeros(1, np.float32)])
    trainer.train(1, 8, 0.1)
    assert (trainer.get_arrays()[0] == 7.0).all()
    trainer.set_arrays([np.ones((1, 3), np.float32), np.zeros(1, np.float32)])
    assert (trainer.model.weight.detach().numpy() == 1.0).all()  # into the swapped-in parameter
