"""Your own model and a CSV table, federated by fedpar (and trained centrally as its baseline); from the repository
root, on the table beside this file (examples/make_table.py writes it):

    fedpar simulate --task examples/own_task.py:task --task-option csv=examples/table.csv --clients 4 --rounds 5
    fedpar train    --task examples/own_task.py:task --task-option csv=examples/table.csv --epochs 5
    fedpar train    --task examples/own_task.py:task --task-option csv=examples/table.csv --epochs 5 --nproc 2 --fsdp 2
    fedpar client   --task examples/own_task.py:task --task-option csv=examples/table.csv --nproc 2 --fsdp 2 ...
"""

from dataclasses import dataclass

import torch
from torch import nn

from fedpar import Task
from fedpar.datasets.tables import load_csv_table
from fedpar.tasks import share_of


@dataclass
class Options:  # --task-option KEY=VALUE, typed as declared here
    csv: str  # a header row, a whole-number 'label' column, numeric feature columns
    hidden: int = 32
    weight_decay: float = 0.0
    dropout: float = 0.0  # after the hidden layer; each client draws its masks from its own stream (seed, id, round)


def task(options: Options) -> Task:
    table = load_csv_table(options.csv)  # a fifth of the rows is held out as the test set
    features, classes = table.input_shape[0], table.num_classes

    def model() -> nn.Module:
        dropout = [nn.Dropout(options.dropout)] if options.dropout else []  # no layer: the weights' names as before
        return nn.Sequential(nn.Linear(features, options.hidden), nn.ReLU(), *dropout,
                             nn.Linear(options.hidden, classes))

    return Task(
        model=model,
        client_data=lambda partition: share_of(table.train, partition),  # this client's rows (and a validation share)
        test_data=lambda: table.test,
        loss=nn.functional.cross_entropy,
        optimizer=lambda params, lr: torch.optim.AdamW(params, lr, weight_decay=options.weight_decay),
    )
