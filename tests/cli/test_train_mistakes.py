"""`fedpar train` told the user's mistakes in one line: a task's own code failing as it trains (in one process and on
two real gloo ranks), an empty training set."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from fedpar.cli.main import main

TASKS = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import Task, ClientData
from fedpar.tasks import share_of

g = torch.Generator().manual_seed(0)
X = torch.randn(80, 10, generator=g)
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()   # 3 classes
TRAIN, TEST = TensorDataset(X[:64], Y[:64]), TensorDataset(X[64:], Y[64:])

def _task(model, data=lambda p: share_of(TRAIN, p), **more):
    return Task(model=model, client_data=data, test_data=lambda: TEST, loss=nn.functional.cross_entropy, **more)

def wrong_out():
    return _task(lambda: nn.Linear(10, 2))

def data_not_clientdata():
    return _task(lambda: nn.Linear(10, 3), data=lambda p: TRAIN)

def no_params_model():
    return _task(lambda: nn.ReLU())

def loss_none_reduction():
    return Task(model=lambda: nn.Linear(10, 3), client_data=lambda p: share_of(TRAIN, p), test_data=lambda: TEST,
                loss=lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"))

def empty_data():
    empty = TensorDataset(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long))
    return _task(lambda: nn.Linear(10, 3), data=lambda p: ClientData(empty))
'''


@pytest.fixture
def tasks(tmp_path):
    path = tmp_path / "tasks.py"
    path.write_text(TASKS)
    return str(path)


def _said(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("factory, code, line", [
    ("wrong_out", 1, "the task's training raised IndexError: Target 2 is out of bounds"),
    ("loss_none_reduction", 1, "loss(outputs, targets) must return the batch's mean loss as a 0-dim tensor, got "
                               "shape [64]"),
    ("data_not_clientdata", 2, "client_data must return fedpar.ClientData(train, val), got TensorDataset"),
    ("no_params_model", 2, "model() has no floating-point parameters"),
    ("empty_data", 2, "client_data gave no training examples"),
])
def test_the_task_s_own_failure_is_one_line_naming_it(factory, code, line, tasks, tmp_path, capsys):
    ref = f"{tasks}:{factory}"
    # on the CPU: on CUDA an out-of-range target is a device-side assert, which ends every later CUDA call here
    got, lines = _said(["train", "--task", ref, "--epochs", "1", "--no-plot", "--device", "cpu",
                        "--out", str(tmp_path / "out")], capsys)
    assert (got, len(lines)) == (code, 1), lines
    assert lines[0].startswith("fedpar train: ") and line in lines[0], lines
    assert lines[0].endswith(f": fix the task ({ref})"), lines
    assert not (tmp_path / "out" / "global.safetensors").exists()


def test_the_zoo_loop_s_options_beside_a_task_are_refused_not_ignored(tasks, tmp_path, capsys):
    # they trained with the task's own optimizer and logged every epoch, exit 0
    code, lines = _said(["train", "--task", f"{tasks}:wrong_out", "--optimizer", "adamw", "--log-every", "2",
                         "--no-plot", "--device", "cpu", "--out", str(tmp_path / "out")], capsys)
    assert (code, lines) == (2, [
        "fedpar train: --task trains with the task's own loop, optimizer and evaluation, one epoch at a time, so "
        "--optimizer and --log-every would be ignored: drop them (it takes --epochs or --max-steps, --lr, "
        "--batch-size, --seed, --checkpoint-every, --resume and the parallel degrees)"])
    assert not (tmp_path / "out").exists()


def test_two_ranks_say_the_task_s_failure_in_one_line_and_debug_shows_the_traceback(tasks, tmp_path, capsys):
    ref = f"{tasks}:wrong_out"
    argv = ["train", "--task", ref, "--epochs", "1", "--no-plot", "--nproc", "2", "--device", "cpu",
            "--out", str(tmp_path / "out")]
    code, lines = _said(argv, capsys)
    assert (code, len(lines)) == (1, 1), lines  # nothing else: no rank's traceback, no launcher's warning
    assert lines[0].startswith("fedpar train: the task's ") and "raised IndexError: Target 2 is out of bounds" in \
        lines[0] and lines[0].endswith(f": fix the task ({ref})"), lines
    with pytest.raises(Exception, match="IndexError"):  # --debug: the ranks' tracebacks
        main([*argv, "--debug"])


@pytest.mark.parametrize("extra, line", [
    (["--dataset", "text", "--data-path", "{tmp}/texts"],  # a folder of one text file is that file (below)
     "fedpar train: text corpus {tmp}/texts is a folder with 2 text files; pass the text file to train on, e.g. "
     "--data-path {tmp}/texts/a.txt"),
    (["--model", "mlp", "--dataset", "csv:{tmp}/none.csv"],
     "fedpar train: --dataset csv:{tmp}/none.csv: {tmp}/none.csv does not exist; pass the path of a CSV file with a "
     "header row, a 'label' column and numeric features, e.g. --dataset csv:data/table.csv"),
    (["--model", "mlp", "--dataset", "npz:{tmp}/corpus"],
     "fedpar train: --dataset npz:{tmp}/corpus: {tmp}/corpus is a folder; pass the path of an .npz file"),
    (["--model", "mlp", "--dataset", "digits", "--nproc", "2", "--fsdp", "-1", "--tp", "-1"],
     "fedpar train: only one degree may be -1 (inferred), got --fsdp -1 --tp -1 and --dp-replicate (-1 by default); "
     "set --dp-replicate (e.g. --dp-replicate 1) and all but one of --fsdp, --tp to a number"),
    # a traceback: the sampler repeated the 1437 examples to fill one batch of 10^12 (a MemoryError)
    (["--model", "mlp", "--dataset", "digits", "--batch-size", str(10**12)],
     "fedpar train: --batch-size 1000000000000 is more than the 1437 training examples of --dataset digits; give "
     "--batch-size 1437 or less"),
    (["--model", "mlp", "--dataset", "digits", "--nproc", "2", "--fsdp", "-1"],
     "fedpar train: only one degree may be -1 (inferred), but --fsdp -1 leaves --dp-replicate to infer too: "
     "--dp-replicate is -1 by default; set it (e.g. --dp-replicate 1), or give --fsdp a number"),
    # options the run would ignore: --data-path trained on digits, the others did nothing (exit 0)
    (["--model", "mlp", "--dataset", "digits", "--data-path", "{tmp}/corpus"],
     "fedpar train: this run would ignore --data-path (it needs --dataset mnist or text): drop it, or give what it "
     "needs"),
    # --model-arg (QA): hidden=8 (one layer's width) was "TypeError: 'int' object is not iterable" as a traceback,
    # num_classes=3 an IndexError traceback from the loss mid-training
    (["--model", "mlp", "--dataset", "digits", "--model-arg", "hidden=x"],
     "fedpar train: model 'mlp' cannot be built with in_features=64, num_classes=10, hidden='x': invalid literal"),
    (["--model", "mlp", "--dataset", "digits", "--model-arg", "num_classes=3"],
     "fedpar train: --model-arg num_classes=3: the data needs at least 10; leave it out and the data sets it"),
    # train has no --clients (QA: the line said "(or --clients)")
    (["--model", "mlp", "--dataset", "synthetic:iid:0"],
     "fedpar train: synthetic dataset 'synthetic:iid:0' needs CLIENTS >= 1 in the name (synthetic:iid:CLIENTS), "
     "ALPHA and BETA in 0..1000 and SAMPLES > 0 (finite numbers)"),
    # a gpt shorter than --block-size (QA): a ValueError traceback from every rank's first forward
    (["--model", "gpt", "--dataset", "text", "--data-path", "{tmp}/corpus/input.txt", "--nproc", "2",
      "--block-size", "32", "--model-arg", "block_size=16"],
     "fedpar train: --model-arg block_size=16: the data needs at least 32; leave it out and the data sets it (or lower "
     "--block-size to 16)"),
    (["--model", "mlp", "--dataset", "digits", "--nproc", "2", "--microbatches", "8", "--cpu-offload"],
     "fedpar train: this run would ignore --microbatches (it needs --pp 2 or more) and --cpu-offload (it needs --fsdp "
     "2 or more): drop them, or give what they need"),
])
def test_a_data_or_layout_mistake_names_the_option_and_what_to_pass(extra, line, tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "input.txt").write_text("to be or not to be " * 20)
    (tmp_path / "texts").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "texts" / name).write_text("to be or not to be " * 20)
    argv = ["train", *[arg.replace("{tmp}", str(tmp_path)) for arg in extra], "--device", "cpu",
            "--out", str(tmp_path / "out")]
    code, lines = _said(argv, capsys)
    assert (code, len(lines)) == (2, 1), lines
    assert lines[0].startswith(line.replace("{tmp}", str(tmp_path))), lines


def test_a_batch_larger_than_one_training_example_says_the_count_in_the_singular(tmp_path, capsys):
    # two rows: one is held out to test, one trains; the line said "more than the 1 training examples"
    (tmp_path / "one.csv").write_text("f,label\n0.1,0\n0.2,1\n")
    table = tmp_path / "one.csv"
    code, lines = _said(["train", "--model", "mlp", "--dataset", f"csv:{table}", "--batch-size", "2", "--device",
                         "cpu", "--out", str(tmp_path / "out")], capsys)
    assert (code, lines) == (2, [f"fedpar train: --batch-size 2 is more than the 1 training example of --dataset "
                                 f"csv:{table}; give --batch-size 1 or less"]), lines


def test_a_text_corpus_trains_the_gpt_without_model_and_a_folder_of_one_text_file_is_that_file(tmp_path, capsys):
    # 'fedpar train --dataset text --data-path DIR' said "use --model gpt, not mlp" (the default), then, given it,
    # that DIR (Tiny Shakespeare's folder, holding input.txt alone) is a folder
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "input.txt").write_text("to be or not to be, that is the question " * 40)
    out = tmp_path / "out"
    code, lines = _said(["train", "--dataset", "text", "--data-path", str(tmp_path / "corpus"), "--block-size", "16",
                         "--model-arg", "n_layer=1", "--model-arg", "d_model=16", "--model-arg", "n_head=2",
                         "--max-steps", "2", "--no-plot", "--device", "cpu", "--out", str(out)], capsys)
    assert (code, lines) == (0, []), lines
    assert json.loads((out / "summary.json").read_text())["model"] == "gpt"


@pytest.mark.parametrize("given, state", [("none.csv", "does not exist"), ("corpus", "is a folder")])
def test_a_task_s_table_that_is_no_file_names_the_task_option_not_dataset(given, state, tmp_path, capsys):
    # the path came through the example task's csv option: the line named --dataset, which the user never gave
    (tmp_path / "corpus").mkdir()
    ref, table = f"{Path(__file__).parents[2] / 'examples' / 'own_task.py'}:task", tmp_path / given
    code, lines = _said(["train", "--task", ref, "--task-option", f"csv={table}", "--device", "cpu",
                         "--out", str(tmp_path / "out")], capsys)
    assert (code, lines) == (2, [
        f"fedpar train: --task {ref}: --task-option csv={table}: the factory raised FileNotFoundError: {table} "
        f"{state}; it must be a CSV file with a header row, a 'label' column and numeric features"]), lines


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_loss_that_diverges_stops_training_in_one_line(nproc, tmp_path, capsys):
    # --lr 1e30 trained on to a NaN model, summary and exit 0 (two ranks: then a traceback of each, had it raised)
    code, lines = _said(["train", "--model", "mlp", "--dataset", "digits", "--lr", "1e30", "--max-steps", "2",
                         "--nproc", str(nproc), "--device", "cpu", "--no-plot", "--out", str(tmp_path / "out")], capsys)
    assert (code, len(lines)) == (1, 1), lines
    assert lines[0] == ("fedpar train: the training loss is nan at step 2 (lr 1e+30): training diverged; lower --lr, "
                        "or set --grad-clip (--debug shows the traceback)"), lines
    assert not (tmp_path / "out" / "global.safetensors").exists()


def test_a_rank_that_lost_its_peer_is_not_said_as_the_task_s_failure():
    # on the 16-core GPU box the follower's gloo error reached the launcher first, said as the task's own failure
    from fedpar.cli.train_task import peer_lost

    assert peer_lost(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                                  "peer [127.0.0.1]:39083"))
    assert not peer_lost(IndexError("Target 2 is out of bounds."))
