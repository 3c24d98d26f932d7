"""How the engine lays out a task's model, without a process group: the modules FSDP shards one by one, and the
checks of a task's tensor-parallel plan."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fedpar.parallel.config import ConfigurationError
from fedpar.parallel.modules import shard_units
from fedpar.parallel.tp import check_plan_divisible


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 4))


def test_fsdp_units_are_the_big_children_inside_a_lone_body():
    model = Body()
    big = [model.net[0], model.net[2]]  # 16 640 and 65 792 parameters; the head holds 1 028
    assert shard_units(model, 10_000) == big
    assert shard_units(model, 100_000) == []  # all gathered with the root
    assert shard_units(nn.Linear(4, 4), 1) == []


def test_a_task_plan_is_checked_against_its_model():
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    check_plan_divisible(model, {"0": ColwiseParallel(), "2": RowwiseParallel()}, 2)
    with pytest.raises(ConfigurationError, match="--tp 4 cannot split layer 0: its 10 outputs are not divisible by 4"):
        check_plan_divisible(model, {"0": ColwiseParallel(), "2": RowwiseParallel()}, 4)
    with pytest.raises(ConfigurationError, match="tp_plan names 'fc', which its model does not have; its modules: 0, "
                                                 "1, 2"):
        check_plan_divisible(model, {"fc": ColwiseParallel()}, 2)
