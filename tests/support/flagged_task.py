"""A task with a bool, a float and a path option (tests of how task options are typed and recorded)."""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fedpar import ClientData, Task


@dataclass
class Options:
    wide: bool = False
    scale: float = 1.0
    notes: Path | None = None


def task(options: Options) -> Task:
    data = torch.utils.data.TensorDataset(torch.randn(8, 2) * options.scale, torch.zeros(8, dtype=torch.long))
    return Task(model=lambda: nn.Linear(2, 4 if options.wide else 2), client_data=lambda p: ClientData(data),
                loss=nn.functional.cross_entropy)
