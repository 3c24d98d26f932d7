"""The built-in models as tasks like any other: what ``--model/--dataset`` stand for.

- ``classifier``: the mlp or the FedAvg CNN on digits, mnist or a table (``csv:PATH``, ``npz:PATH``), with
  cross-entropy, plain SGD and the built-in evaluation (test_loss, test_accuracy);
- ``language_model``: the small GPT on a character-level text corpus (next-token cross-entropy).

``fedpar simulate --model mlp --dataset digits`` and ``--task fedpar.tasks.zoo:classifier --task-option model=mlp
--task-option dataset=digits`` run the same task.
"""

from __future__ import annotations

import copy
import functools

import numpy as np

from torch import nn
from torch.utils.data import TensorDataset

from fedpar.datasets import DatasetSplits, load_dataset, load_text
from fedpar.datasets.text import text_windows
from fedpar.datasets.clientdata import local_split
from fedpar.datasets.members import member_source
from fedpar.models import build_model, build_model_for_data
from fedpar.models.losses import classification_loss, language_model_loss
from fedpar.task import ClientData, Partition, Task, TaskError
from fedpar.tasks.data import share_of


def classifier(model: str = "mlp", dataset: str = "digits", data_dir: str | None = None,
               examples_per_client: int | None = None) -> Task:
    """Zoo classifier ``model`` on ``dataset`` (loaded once, when the task is made)."""
    return classifier_for(model, load_dataset(dataset, data_dir), dataset, examples_per_client)


def classifier_for(model: str, splits: DatasetSplits, dataset: str = "",
                   examples_per_client: int | None = None) -> Task:
    """Zoo classifier ``model`` sized for ``splits``: clients get shares of ``splits.train`` as their Partition
    says (``natural``: the data's own owners), made when asked for (datasets/members.py); the coordinator evaluates
    on ``splits.test``."""
    shape, classes = splits.input_shape, splits.num_classes
    build_model_for_data(model, shape, classes)  # an unknown model or a shape it cannot take fails now

    @functools.lru_cache(maxsize=4)
    def members(scheme: str, count: int, seed: int):
        return member_source(splits, scheme, count, seed, examples_per_client)

    def client_data(p: Partition) -> ClientData:
        source = members(p.scheme, p.count, p.seed)
        if not 0 <= p.index < len(source.sizes):
            raise TaskError(f"partition index {p.index} is not in [0, {len(source.sizes)})")
        examples = source.examples(p.index)
        train, val = local_split(examples, np.arange(len(examples)), p.val_fraction, p.seed)
        return ClientData(train, val)

    description = {"model": model, "input_shape": list(shape), "num_classes": classes}
    if dataset:
        description["dataset"] = dataset
    return Task(model=lambda: build_model_for_data(model, shape, classes), client_data=client_data,
                test_data=lambda: splits.test.whole(), loss=classification_loss,
                tp_plan=_mlp_tp_plan if model == "mlp" else None,
                name=f"{model} on {dataset}" if dataset else model, description=description)


def _mlp_tp_plan(model: nn.Module) -> dict:
    """The zoo MLP's tensor-parallel plan: its Linear layers in column-wise, row-wise pairs (parallel/tp.py)."""
    from fedpar.parallel.tp import mlp_plan

    return mlp_plan(model)


def classifier_module(model: nn.Module) -> Task:
    """``model``, a classifier built already, trained as the zoo's are (cross-entropy, plain SGD, the built-in
    evaluation): the task of :class:`fedpar.client.trainer.LocalTrainer`, which is given the model and the data."""

    def no_data(partition: Partition) -> ClientData:
        raise TaskError("this task's data is given to its trainer directly; it has no client_data")

    return Task(model=lambda: copy.deepcopy(model), client_data=no_data, loss=classification_loss,
                name=type(model).__name__.lower())


def language_model(data_path: str, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                   d_model: int = 64) -> Task:
    """The zoo GPT on the characters of the text file ``data_path``: windows of ``block_size`` characters, the
    first 90% of the text shared among the clients, the rest evaluated on."""
    corpus = load_text(data_path, block_size)
    train = TensorDataset(*text_windows(corpus.train, block_size))
    test = TensorDataset(*text_windows(corpus.val, block_size))
    sizes = dict(vocab_size=corpus.vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                 d_model=d_model)
    return Task(model=lambda: build_model("gpt", **sizes), client_data=lambda p: share_of(train, p),
                test_data=lambda: test, loss=language_model_loss, name=f"gpt on {data_path}",
                description={"model": "gpt", **sizes})
