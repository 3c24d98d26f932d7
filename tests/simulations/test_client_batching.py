"""The per-process batcher: agents holding a task of a round train in one batch, with LocalTrainer's results."""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import fields

import numpy as np
import pytest
import torch

from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import load_dataset
from fedpar.models.for_data import build_model_for_data
from fedpar.simulations.client_batching import (STACK_BYTES, BatchedTrainer, ClientBatcher, batched_seats,
                                              batching_pays, batching_refusal_of, client_batching_route)
from fedpar.task import ClientData
from fedpar.tasks.zoo import classifier_module

EPOCHS, BATCH, LR, ROUND = 2, 16, 0.1, 1


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainers(batcher: ClientBatcher, sizes, delays=None):
    """BatchedTrainers (and their LocalTrainer twins) on digits shares of ``sizes`` examples, one model each."""
    splits = load_dataset("digits")
    offsets = np.cumsum((0,) + tuple(sizes))
    torch.manual_seed(0)
    model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
    batched, alone = [], []
    for k, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        data = splits.train.subset(np.arange(a, b))
        delay = delays[k] if delays else 0.0
        batched.append(BatchedTrainer(classifier_module(copy.deepcopy(model)), ClientData(data), batcher, seed=k,
                                      seconds_per_step_delay=delay))
        alone.append(LocalTrainer(copy.deepcopy(model), data, seed=k))
    return batched, alone


def _agent(trainer, results, k, returned=None, takes=0.0):
    """What a seat does with a task: take it (``takes`` seconds after the start), hold it, then train
    (``returned``: when train returned)."""
    time.sleep(takes)
    with trainer.holding_task(ROUND):
        time.sleep(0.01 * k)  # the seats reach train() a little apart
        results[k] = trainer.train(EPOCHS, BATCH, LR, round_id=ROUND)
        if returned is not None:
            returned[k] = time.monotonic()


def _run_threads(targets):
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_agents_holding_tasks_of_a_round_train_in_one_batch_with_local_trainer_results():
    batcher = ClientBatcher(gather_seconds=10.0)
    batched, alone = _trainers(batcher, (40, 75, 33), delays=(0.0, 0.0, 0.02))
    results, returned = [None] * 3, [0.0] * 3
    batched[0].warm_up()  # torch.func's one-time set-up (seconds on a loaded machine) is not the batch's wait
    batched[0].tasks_queued(ROUND, 3)
    started = time.monotonic()
    _run_threads([lambda k=k: _agent(batched[k], results, k, returned) for k in range(3)])
    assert time.monotonic() - started < 5.0  # nobody waited for the gather window
    assert list(batcher.batch_sizes) == [3]
    for k in range(3):
        want = alone[k].train(EPOCHS, BATCH, LR, round_id=ROUND)
        got = results[k]
        assert (got.steps, got.examples, got.stopped_early) == (want.steps, want.examples, want.stopped_early)
        assert got.loss == pytest.approx(want.loss, rel=1e-6)
        for p, q in zip(batched[k].get_arrays(), alone[k].model.parameters()):  # its row of the stack
            q = q.detach().numpy()
            assert abs(p - q).max() <= 2e-6 * abs(q).max()
    # The slow device's simulated delays are billed to its clock and waited out before it returns (uploads).
    assert results[2].seconds - results[0].seconds == pytest.approx(results[2].steps * 0.02)
    assert returned[2] - max(returned[:2]) >= 0.9 * results[2].steps * 0.02


def test_seats_given_the_round_s_global_weights_train_from_them_and_read_them_before_training():
    """set_arrays checks the weights at once, the stack starts from them (the model gets them only when read) and
    an evaluation before training scores them: as a LocalTrainer given the same weights."""
    batcher = ClientBatcher(gather_seconds=10.0)
    batched, alone = _trainers(batcher, (40, 75))
    rng = np.random.default_rng(3)
    global_weights = [rng.normal(0, 0.1, a.shape).astype(np.float32) for a in alone[0].get_arrays()]
    for b in global_weights:
        b.flags.writeable = False  # as decoded from the wire
    with pytest.raises(ValueError, match="has shape"):
        batched[0].set_arrays([w[:1] for w in global_weights])
    for trainer in (*batched, *alone):
        trainer.set_arrays(global_weights)
    split = batched[1].data.train
    scored = batched[1].evaluate_splits([split])[0]
    assert scored.loss == pytest.approx(alone[1].evaluate_splits([split])[0].loss, rel=1e-6)
    batched[0].warm_up()
    batched[0].tasks_queued(ROUND, 2)
    results = [None] * 2
    _run_threads([lambda k=k: _agent(batched[k], results, k) for k in range(2)])
    assert list(batcher.batch_sizes) == [2]
    for k in range(2):
        assert results[k].loss == pytest.approx(alone[k].train(EPOCHS, BATCH, LR, round_id=ROUND).loss, rel=1e-6)
        for p, q in zip(batched[k].get_arrays(), alone[k].get_arrays()):
            assert abs(p - q).max() <= 2e-6 * abs(q).max()
    assert all(not w.flags.writeable for w in global_weights)  # nothing wrote into the round's weights


def test_an_agent_that_holds_a_task_but_never_trains_delays_the_batch_by_the_gather_window_at_most():
    batcher = ClientBatcher(gather_seconds=0.5)
    batched, _ = _trainers(batcher, (20, 20))
    results = [None] * 2
    never = threading.Event()

    def silent_holder():
        with batcher.holding(object(), ROUND):
            never.wait(3.0)

    holder = threading.Thread(target=silent_holder)
    holder.start()
    time.sleep(0.05)
    started = time.monotonic()
    _run_threads([lambda k=k: _agent(batched[k], results, k) for k in range(2)])
    waited = time.monotonic() - started
    never.set()
    holder.join()
    assert list(batcher.batch_sizes) == [2] and all(r.steps == EPOCHS * 2 for r in results)
    assert 0.5 <= waited < 2.5


def test_an_agent_that_leaves_its_task_releases_the_batch_at_once():
    batcher = ClientBatcher(gather_seconds=5.0)
    (trainer,), _ = _trainers(batcher, (20,))
    results = [None]
    leaves = threading.Event()

    def leaving_holder():
        with batcher.holding(object(), ROUND):
            leaves.wait(3.0)  # e.g. its download failed

    holder = threading.Thread(target=leaving_holder)
    holder.start()
    time.sleep(0.05)
    worker = threading.Thread(target=_agent, args=(trainer, results, 0))
    started = time.monotonic()
    worker.start()
    time.sleep(0.3)
    assert results[0] is None  # still waiting for the other holder
    leaves.set()
    worker.join(10)
    holder.join()
    assert results[0] is not None and time.monotonic() - started < 2.0


def test_a_queued_task_that_a_seat_takes_after_another_seats_train_call_joins_its_batch():
    # Three agents in the process, two tasks of the round queued: the first is trained at once, the second is
    # taken 0.3 s later. The batch waits for it (it was counted when queued), not for the third agent.
    batcher = ClientBatcher(gather_seconds=10.0)
    batched, _ = _trainers(batcher, (20, 20, 20))
    batched[0].warm_up()
    results = [None] * 2
    batched[0].tasks_queued(ROUND, 2)  # what the runtime says before it queues a pull's tasks
    started = time.monotonic()
    _run_threads([lambda: _agent(batched[0], results, 0), lambda: _agent(batched[1], results, 1, takes=0.3)])
    assert list(batcher.batch_sizes) == [2] and results[0].steps == results[1].steps == EPOCHS * 2
    assert 0.3 <= time.monotonic() - started < 5.0  # no gather window waited out


def test_queued_tasks_that_no_seat_is_free_to_take_do_not_hold_the_batch():
    # Three tasks queued for two agents: both train at once; the third waits for a seat, not the batch for it.
    batcher = ClientBatcher(gather_seconds=10.0)
    batched, _ = _trainers(batcher, (20, 20))
    batched[0].warm_up()
    results = [None] * 2
    batched[1].tasks_queued(ROUND, 3)
    started = time.monotonic()
    _run_threads([lambda k=k: _agent(batched[k], results, k) for k in range(2)])
    assert list(batcher.batch_sizes) == [2] and time.monotonic() - started < 5.0
    batched[0].tasks_queued(ROUND, -1)  # dropped unstarted: a later batch of the round waits for none
    _run_threads([lambda: _agent(batched[0], results, 0)])
    assert list(batcher.batch_sizes) == [2, 1] and time.monotonic() - started < 5.0


def _cnn(dropout: float = 0.0) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Dropout(dropout), torch.nn.Flatten(),
                               torch.nn.Linear(72, 10))


def _mlp() -> torch.nn.Module:
    return build_model_for_data("mlp", (1, 8, 8), 10)


@pytest.mark.parametrize("choice, model, device, members, everyone, batched", [
    (None, _cnn(), "cuda:0", 5, False, True),  # auto: allowed, several members a worker, a GPU: stacked
    (None, _mlp(), "cpu", 50, True, True),  # the CPU: no convolution, 50 members a worker, all sampled: stacked
    (None, _mlp(), "cpu", 5, True, True),  # ... and 5 (10 of 10 on 2 workers)
    (None, _mlp(), "cpu", 4, True, False),  # ... fewer members a worker were not measured
    (None, _mlp(), "cpu", 5, False, False),  # ... nor members sampled from a larger population (10 of 100: not faster)
    (None, _cnn(), "cpu", 50, True, False),  # a vmapped convolution steps slower on the CPU
    (None, _cnn(), "cuda:0", 1, False, False),  # one member of a round a worker: nothing to stack
    (None, _cnn(0.5), "cuda:0", 5, False, False),  # dropout: one by one, without a word
    (False, _cnn(), "cuda:0", 5, True, False),
    (True, _mlp(), "cpu", 1, False, True),  # on: whatever auto would say
])
def test_auto_batches_where_it_is_allowed_and_pays_and_on_and_off_are_obeyed(choice, model, device, members,
                                                                               everyone, batched):
    assert client_batching_route(choice, lambda: batching_refusal_of(model, None, "fp32", None), device,
                                 members, model, everyone) is batched


@pytest.mark.parametrize("model, image, members, everyone, stacked", [
    ("cnn", 28, 5, False, False),  # the FedAvg paper's MNIST round, 10 of 100 on 2 workers: 1.09-1.12x in CPU time
    ("cnn", 28, 5, True, False),  # ... not for want of sampling: the stack itself is slower
    ("cnn", 8, 5, True, False),  # digits CNN 10 of 10: 0.96-1.07x (even at best)
    ("cnn", 8, 50, True, False),  # ... 100 of 100: 1.09-1.38x
    ("mlp", 28, 5, True, True),  # MNIST MLP 10 of 10: 0.78-0.95x
    ("mlp", 28, 50, True, True),  # ... 100 of 100: 0.75-0.87x
    ("mlp", 8, 50, True, True),  # digits MLP 100 of 100: 0.37-0.53x
])
def test_auto_on_the_cpu_stacks_the_shapes_measured_faster_stacked_and_no_others(model, image, members, everyone,
                                                                                   stacked):
    # benchmarks/stacked_cpu_bench.py's cells (batching_pays says which measurement each decision rests on)
    net = build_model_for_data(model, (1, image, image), 10)
    assert batching_pays("cpu", net, members, everyone) is stacked


def test_the_help_of_client_batching_states_autos_thresholds():
    """It said 50 members a worker on the CPU where auto stacks from 5."""
    from fedpar.simulations.client_batching import AUTO_MIN_MEMBERS, AUTO_MIN_MEMBERS_CPU
    from fedpar.simulations.config import SimulationConfig

    field = next(f for f in fields(SimulationConfig) if f.name == "client_batching")
    help_text = " ".join(field.metadata["help"].split())
    assert f"on a GPU when each worker holds at least {AUTO_MIN_MEMBERS} clients" in help_text
    assert f"when each worker trains at least {AUTO_MIN_MEMBERS_CPU} clients of a round" in help_text


def test_batching_on_with_a_model_that_cannot_stack_is_its_refusal():
    model = _cnn(0.5)
    with pytest.raises(ValueError, match="^client batching needs a model without batch-norm statistics or dropout"):
        client_batching_route(True, lambda: batching_refusal_of(model, None, "fp32", None), "cpu", 5, model, True)
    with pytest.raises(ValueError, match="^--client-batching trains in fp32"):
        client_batching_route(True, lambda: batching_refusal_of(_cnn(), None, "bf16", None), "cpu", 5, _cnn(), True)


def test_a_batching_worker_seats_every_member_it_may_train_in_a_round_as_far_as_the_stack_memory_allows():
    small = 100_000  # bytes of parameters: the digits MLP's order
    assert batched_seats(4, 50, 100, small) == 50  # 100 of 100 on 2 workers: each worker's 50 in one stack
    assert batched_seats(4, 500_000, 100, small) == 100  # no more than a round samples
    assert batched_seats(4, 2, 100, small) == 4  # never fewer than --seats
    assert batched_seats(4, 50, 100, STACK_BYTES // 8 // 10) == 10  # 10 members' copies fill the stack's memory
    assert batched_seats(4, 50, 100, STACK_BYTES) == 4


@pytest.mark.timeout(120)
def test_a_member_whose_data_fails_to_load_leaves_its_rounds_stack_at_once():
    # A real coordinator and a batching host of 4 members, all sampled, a round closing at 3 reports. Member 3's
    # data never loads: its task fails as its seat takes it, and the other three's stack starts without waiting out
    # the gather window (made 10 s here: a round that waited for the failed member would take longer). The others
    # score the model they receive together, which must not fail on member 3's data.
    import dataclasses

    from fedpar.simulations.population import host_population
    from support.population_host import digits_population

    clients, rounds = 4, 2
    rows: list[dict] = []
    # the members scored together (client_eval_every=1): member 3's data fails only its own task
    with digits_population(clients, rows, rounds=rounds, clients_per_round=3, overselect=1.34, local_epochs=1,
                           client_eval_every=1) as (worker, task):

        def client_data(partition):
            if partition.index == 3:
                raise OSError("member 3's data is unreadable")
            return task.client_data(partition)

        host = host_population(worker.server, worker.population, dataclasses.replace(task, client_data=client_data),
                               worker.partition_of, 0, seats=clients, poll_seconds=1.0, client_batching=True)
        host.seats[0].trainer.batcher.gather_seconds = 10.0
        host.run()  # until the coordinator says training is over
    assert [(r["status"], r["reported"]) for r in rows] == [("ok", 3)] * rounds
    assert all(r["round_seconds"] < 5.0 for r in rows), [r["round_seconds"] for r in rows]
    assert list(host.seats[0].trainer.batcher.batch_sizes) == [3] * rounds


def test_client_data_that_is_not_a_client_data_is_left_to_the_workers_one_line():
    # on a GPU (where stacking pays) the check read member_data.train: an AttributeError traceback for a tuple
    splits = load_dataset("digits")
    model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
    assert batching_refusal_of(model, None, "fp32", splits.train.to_tensors()) is None


def test_a_stacked_member_whose_loss_diverged_is_said_as_its_own_loop_says_it(tmp_path, capsys):
    from fedpar.cli.main import main

    assert main(["simulate", "--clients", "4", "--rounds", "1", "--lr", "1e30", "--client-batching", "on",
                 "--quiet", "--out", str(tmp_path / "out")]) != 0
    assert ("every round failed (1 of 1): the members' training failed: task 'mlp on digits': the training loss is "
            "nan (lr 1e+30): training diverged (lower --lr)") in capsys.readouterr().err
