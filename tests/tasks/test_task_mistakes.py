"""A user's own task, written the ways users get it wrong (tests/support/user_tasks.py): what cannot work is one
line saying what to change, found as the task loads where it can be; what can work learns, with each member's own
figures."""

from __future__ import annotations

import json
import re
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedpar import ClientData, Partition, TaskError
from fedpar.client.task_trainer import TaskTrainer
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.tasks import evaluation
from fedpar.tasks.evaluation import named_metrics, task_eval_result, task_eval_results
from fedpar.tasks.reference import load_task
from support import user_tasks
from support.in_process import run_main
from support.user_tasks import TEST, TRAIN, X, Y, ref


def _loaded(name: str):
    return load_task(ref(name))


@pytest.mark.parametrize("name, line", [
    ("lazy", "model() has lazy parameters of no shape yet (nn.LazyLinear, ...), but the coordinator needs the weights' "
             "shapes before any data: give those layers their input sizes"),
    ("bfloat16", "model()'s state entry '0.weight' has dtype torch.bfloat16, which numpy cannot hold"),
    ("random_width", "model() made other weights than on its first call ('0.weight' float32 (32, 10), where the first "
                     "had '0.weight' float32 (8, 10)); it must build the same model every call"),
    ("per_example_loss", "loss(outputs, targets) must return the batch's mean loss as a 0-dim tensor, got shape [64]: "
                         "reduce it (.mean()"),
])
def test_a_model_or_loss_that_cannot_federate_is_one_line_as_the_coordinator_loads_it(name, line):
    # before: a lazy layer, torch's own message on UninitializedParameter; bfloat16 trained, then a traceback writing
    # global.safetensors (train); a width drawn anew, the coordinator's evaluator traceback after round 1; a loss per
    # example, 'output with shape [] doesn't match the broadcast shape [64]'
    with pytest.raises(TaskError) as raised:
        CoordinatorAssembly.for_task(_loaded(name), seed=0, eval_device="cpu")
    assert line in str(raised.value) and "\n" not in str(raised.value)


def test_an_agent_whose_client_data_raises_or_is_a_pair_of_arrays_is_one_line_and_exit_2(capfd, monkeypatch):
    # before: fedpar client's traceback of the task's KeyError; a pair of arrays trained as 2 'examples' and failed
    # each round with 'stack expects each tensor to be equal size'
    base = ["client", "--insecure", "--server", "127.0.0.1:9", "--agent-id", "a1", "--num-partitions", "2"]
    out = run_main([*base, "--task", ref("one_member_fails"), "--partition-index", "1"], capfd)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1:] == [
        f"fedpar client: the task's client_data raised KeyError: 'no rows for client 1' for partition 1 of 2: fix the "
        f"task ({ref('one_member_fails')})"]
    task = _loaded("batch_norm")
    monkeypatch.setattr(task, "client_data", lambda partition: ClientData((X[:100], Y[:100])))
    with pytest.raises(TaskError, match=r"ClientData.train is a tuple of arrays, not a dataset of examples: give "
                                        r"TensorDataset\(inputs, targets\)"):
        task.data_for(Partition(0, 2))


def test_a_loss_that_turns_nan_stops_the_members_training_saying_so():
    # before: fedpar train went on with a NaN model, printed no loss and exited 0 (simulate said 'left NaN in
    # tensor' only after the upload)
    trainer = TaskTrainer(_loaded("nan_loss"), user_tasks.share_of(TRAIN, Partition(0, 2)))
    with pytest.raises(TaskError, match=r"the training loss is nan \(lr 0.1\): training diverged \(lower --lr\), or "
                                        r"loss\(outputs, targets\) is not finite"):
        trainer.train(1, 32, 0.1)


@pytest.mark.parametrize("name", ["dict_out", "tuple_out"])
def test_members_scored_together_get_their_own_figures_when_the_model_outputs_a_dict_or_tuple(name):
    # before: a dict raised "unhashable type: 'slice'" in every member's evaluation (each round failed); a tuple was
    # cut as a tuple, so each member was given the loss of all members' examples together
    task = _loaded(name)
    model = task.built_model()
    splits = [TensorDataset(X[:30], Y[:30]), TensorDataset(X[30:100], Y[30:100])]
    together = task_eval_results(task, model, splits)
    alone = [task_eval_result(task, model, split) for split in splits]
    assert [r.loss for r in together] == pytest.approx([r.loss for r in alone])
    assert together[0].loss != pytest.approx(together[1].loss)


def test_a_metric_that_is_not_finite_is_said_once_and_left_out(caplog, monkeypatch):
    # before: a NaN metric vanished from every row without a word
    monkeypatch.setattr(evaluation, "_SAID_NOT_FINITE", set())
    task = _loaded("nan_metric")
    with caplog.at_level(logging.WARNING, logger="fedpar.tasks"):
        for _ in range(3):
            metrics = named_metrics(task, "evaluate", {"f1": float("nan"), "n": 3})
    assert metrics["n"] == 3.0 and [r.getMessage() for r in caplog.records] == [
        f"task {ref('nan_metric')!r}: evaluate gave f1 = nan, which is left out of the metrics (they hold finite "
        "numbers only); leave a metric out where it cannot be measured"]


def test_a_batch_norm_model_with_dict_outputs_and_a_member_smaller_than_a_batch_learns(tmp_path, capfd):
    # the default route (2 worker processes): BatchNorm's running statistics travel and are averaged (its int64
    # num_batches_tracked stays with each member), member 0 holds 3 examples and no validation set
    out = tmp_path / "run"
    run = run_main(["simulate", "--task", ref("batch_norm_dict_tiny"), "--clients", "3", "--rounds", "3",
                    "--lr", "0.2", "--out", str(out), "--quiet"], capfd)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "WARNING" not in run.stderr, run.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok"] * 3 and all(r["reported"] == 3 for r in rows)
    assert rows[-1]["test_loss"] < rows[0]["test_loss"] and rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert all("federated_eval_loss" in r for r in rows)
    from safetensors.numpy import load_file

    saved = load_file(out / "global.safetensors")
    assert {"1.running_mean", "1.running_var"} <= set(saved) and "1.num_batches_tracked" not in saved
    assert abs(saved["1.running_mean"]).max() > 0  # the members' statistics, averaged
    model = load_task(*json.loads((out / "global.json").read_text())["model"].values()).built_model()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in saved.items()}, strict=False)
    assert isinstance(model(X[:4])["logits"], torch.Tensor)


@pytest.mark.parametrize("result, line", [
    ((10**9, {}), "train returned 1000000000 examples, more than its 144 training examples x 1 epochs: count each "
                  "example once per pass"),
    ((10, {"big": 1e200}), "train metric 'big' = 1e+200 is beyond the +-1e+100 an update carries"),
    ((10, {f"m{i}": 1.0 for i in range(30)}), "train returned 30 metrics, more than the 29 an update carries"),
])
def test_a_train_hook_s_report_the_coordinator_would_refuse_fails_the_member_at_once(result, line):
    # before: the update went up in the background, was refused, and the round waited out its deadline (20 s here)
    # for it; the run then ended 'too few updates arrived ... check --min-reports, --deadline'
    task = _loaded("batch_norm")
    task.train = lambda model, data, config, deadline: result
    trainer = TaskTrainer(task, task.data_for(Partition(0, 2)))
    with pytest.raises(TaskError, match=re.escape(line)):
        trainer.train(1, 32, 0.1)


def test_task_options_of_choices_lists_and_any_name_are_typed_or_refused_in_one_line(tmp_path):
    # before: a Literal or an Enum took any text ('sigmoid'), a list[int] got the text '16,32', and a factory of
    # **options was refused as taking no options
    task = load_task(ref("declared"), {"activation": "tanh", "norm": "BATCH"})
    assert task.description["task_options"] == {"activation": "tanh", "norm": "batch"}  # rebuilds as given back
    assert load_task(ref("declared"), task.description["task_options"]).description == task.description
    assert load_task(ref("declared"), {"layers": [8, 8]}).description["task_options"] == {"layers": [8, 8]}  # TOML
    for options, line in [
            ({"activation": "sigmoid"}, "option 'activation' must be one of relu, tanh, got 'sigmoid'"),
            ({"layers": "16,32"}, "option 'layers' is declared list[int], which a --task-option's text cannot give: "
                                  "set it in a --config file's task_options table")]:
        with pytest.raises(TaskError, match=re.escape(line)):
            load_task(ref("declared"), options)
    assert load_task(ref("any_options"), {"hidden": "8"}).built_model()[0].out_features == 8
    sibling = tmp_path / "helpers.py"
    sibling.write_text("HIDDEN = 4\n")
    (tmp_path / "task.py").write_text("import helpers\n")
    with pytest.raises(TaskError, match=re.escape(f"(helpers lies beside it, but its folder is not on sys.path: run "
                                                  f"with PYTHONPATH={tmp_path})")):
        load_task(f"{tmp_path / 'task.py'}:task")


def test_a_dataset_of_dict_items_with_a_loader_making_pairs_trains_and_is_evaluated():
    # before: its loader trained it, but the built-in evaluation batched the dicts itself and failed each member with
    # 'this task's loader gave a dict: give the task a loader that yields pairs'
    task = _loaded("dict_examples")
    assembly = CoordinatorAssembly.for_task(task, seed=0, eval_device="cpu")  # its central evaluation, checked
    trainer = TaskTrainer(task, task.data_for(Partition(0, 2)))
    trainer.set_arrays(assembly.weights)
    before = trainer.evaluate()
    trainer.train(3, 16, 0.2)
    after = trainer.evaluate()
    assert after.examples == 10 and after.loss < before.loss
    assert assembly.evaluate(trainer.get_arrays())["test_loss"] < assembly.evaluate(assembly.weights)["test_loss"]


def test_client_batching_on_refuses_a_model_whose_output_is_not_one_tensor():
    """--client-batching on with a dict-output model failed every round ("'dict' object has no attribute
    'unsqueeze': fix the task") though the task is fine one member at a time (auto trains it so)."""
    from fedpar.simulations.client_batching import batching_refusal_of

    for factory, kind in ((user_tasks.dict_out, "dict"), (user_tasks.tuple_out, "tuple")):
        task = factory()
        refusal = batching_refusal_of(task.built_model(), task, "fp32", task.data_for(Partition(0, 2)))
        assert refusal == (f"--client-batching stacks the model's output, which must be one tensor; this model "
                           f"returns a {kind} (drop --client-batching)")
