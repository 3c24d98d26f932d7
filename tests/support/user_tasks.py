"""Tasks written the way users write them, the right way and the wrong ways: each a factory for ``--task
tests/support/user_tasks.py:NAME`` (tests/tasks/test_task_mistakes.py)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedpar import ClientData, Task
from fedpar.tasks import share_of

FILE = str(Path(__file__).resolve())

_g = torch.Generator().manual_seed(0)
X = torch.randn(400, 10, generator=_g)
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()  # 3 classes
TRAIN, TEST = TensorDataset(X[:320], Y[:320]), TensorDataset(X[320:], Y[320:])


class Norm(enum.Enum):
    NONE = "none"
    BATCH = "batch"


def ref(name: str) -> str:
    """The --task reference of this file's factory ``name``."""
    return f"{FILE}:{name}"


def _mlp(hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def _task(model=_mlp, **hooks) -> Task:
    hooks.setdefault("loss", nn.functional.cross_entropy)
    hooks.setdefault("client_data", lambda partition: share_of(TRAIN, partition))
    return Task(model=model, test_data=lambda: TEST, **hooks)


class DictOut(nn.Module):
    """A model whose forward returns a dict, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.body = _mlp()

    def forward(self, x):
        return {"logits": self.body(x)}


class TupleOut(nn.Module):
    """A model whose forward returns (scores, a batch-wide extra)."""

    def __init__(self):
        super().__init__()
        self.body = _mlp()

    def forward(self, x):
        scores = self.body(x)
        return scores, scores.sum()


def dict_out() -> Task:
    return _task(model=DictOut, loss=lambda out, y: nn.functional.cross_entropy(out["logits"], y))


def tuple_out() -> Task:
    return _task(model=TupleOut, loss=lambda out, y: nn.functional.cross_entropy(out[0], y))


def batch_norm() -> Task:
    return _task(model=lambda: nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)))


def per_example_loss() -> Task:  # reduction="none": a loss per example, not one number
    return _task(loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"))


def nan_loss() -> Task:
    return _task(loss=lambda out, y: nn.functional.cross_entropy(out, y) * float("nan"))


def nan_metric() -> Task:
    return _task(evaluate=lambda model, dataset: {"f1": float("nan"), "examples_seen": float(len(dataset))})


def random_width() -> Task:  # a width drawn anew on each model() call (here: 8, then 32)
    widths = itertools.cycle([8, 32])
    return _task(model=lambda: _mlp(next(widths)))


def lazy() -> Task:
    return _task(model=lambda: nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 3)))


def bfloat16() -> Task:
    return _task(model=lambda: _mlp().bfloat16())


def one_member_fails() -> Task:
    def client_data(partition):
        if partition.index == 1:
            raise KeyError("no rows for client 1")
        return share_of(TRAIN, partition)
    return _task(client_data=client_data)


def tiny_members() -> Task:  # 3 training examples (under a batch) and no validation examples for member 0
    def client_data(partition):
        if partition.index == 0:
            return ClientData(TensorDataset(X[:3], Y[:3]), TensorDataset(X[:0], Y[:0]))
        return share_of(TRAIN, partition)
    return _task(client_data=client_data)


class BatchNormDict(nn.Module):
    """BatchNorm's running statistics (and its int64 num_batches_tracked) beside the weights; a dict of outputs."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return {"logits": self.body(x)}

    def state_dict(self, *args, **kwargs):  # the layers' names as an nn.Sequential of them has them
        return self.body.state_dict(*args, **kwargs)

    def load_state_dict(self, state, strict=True, assign=False):
        return self.body.load_state_dict(state, strict, assign)


def batch_norm_dict_tiny() -> Task:
    return _task(model=BatchNormDict, loss=lambda out, y: nn.functional.cross_entropy(out["logits"], y),
                 client_data=tiny_members().client_data)


@dataclass
class Options:
    layers: list[int] = field(default_factory=lambda: [16])
    activation: Literal["relu", "tanh"] = "relu"
    norm: Norm = Norm.NONE


def declared(options: Options) -> Task:  # types a --task-option's text cannot give, and choices
    return _task()


def any_options(**options) -> Task:
    return _task(model=lambda: _mlp(int(options.get("hidden", 16))))


class DictExamples(torch.utils.data.Dataset):
    """A dataset whose items are dicts, as Hugging Face datasets give them."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def dict_examples() -> Task:  # its loader makes the dicts (inputs, targets), for training and evaluation alike
    def loader(dataset, batch_size, generator):
        batches = torch.utils.data.DataLoader(dataset, batch_size, shuffle=True, generator=generator)
        return ((batch["x"], batch["y"]) for batch in batches)
    return Task(model=_mlp, loss=nn.functional.cross_entropy, loader=loader,
                test_data=lambda: DictExamples(X[320:], Y[320:]),
                client_data=lambda p: ClientData(DictExamples(X[p.index:320:p.count], Y[p.index:320:p.count]),
                                                 DictExamples(X[300 + p.index:320:p.count], Y[300 + p.index:320:p.count])))
