"""A CoordinatorConfig built in Python gets the checks its flags get on the command line (each setting's declared
type and range), in one line naming the setting, as it is built: not a TypeError from deep in a started server."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from torch import nn
from torch.utils.data import TensorDataset
import torch

from fedpar import ClientData, Task
from fedpar.aggregation import FedAvg, build_strategy
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.config import CoordinatorConfig


@pytest.mark.parametrize("settings, error, line", [
    # before: accepted; server.start() then "TypeError: '>=' not supported between 'str' and 'int'"
    (dict(rounds="3"), TypeError, "CoordinatorConfig's rounds must be an integer, got '3'"),
    # before: accepted; the run did nothing
    (dict(rounds=0), ValueError, "CoordinatorConfig's rounds: 0 is out of range: a count must be at least 1"),
    (dict(deadline_seconds=-1.0), ValueError,
     "CoordinatorConfig's deadline_seconds: -1.0 is out of range: seconds must be in (0, 1e+09]"),
    (dict(seed=True), TypeError, "CoordinatorConfig's seed must be an integer, got True"),
    (dict(fraction="half"), TypeError, "CoordinatorConfig's fraction must be a number, got 'half'"),
])
def test_a_setting_of_the_wrong_type_or_out_of_range_is_refused_as_the_config_is_built(settings, error, line):
    with pytest.raises(error) as raised:
        CoordinatorConfig(**settings)
    assert str(raised.value) == line


def test_configs_built_by_replace_or_with_numpy_numbers_still_build():
    config = dataclasses.replace(CoordinatorConfig(), rounds=np.int64(3), deadline_seconds=np.float32(2.5),
                                 fraction=None, learning_rate=1)
    assert (config.rounds, config.deadline_seconds, config.learning_rate) == (3, 2.5, 1)
    with pytest.raises(ValueError, match="CoordinatorConfig's min_reports: 0 is out of range"):
        dataclasses.replace(config, min_reports=0)


def test_a_strategy_given_by_name_to_server_says_how_to_build_one():
    # before: AttributeError: 'str' object has no attribute 'fold_many' (server/round_modes.py), once rounds ran
    task = Task(model=lambda: nn.Linear(4, 2), client_data=lambda p: ClientData(TensorDataset(torch.zeros(4, 4))),
                loss=nn.functional.cross_entropy)
    assembly = CoordinatorAssembly.for_task(task, 0, None)
    with pytest.raises(TypeError, match=r"^server takes a strategy object, got str 'fedavg': give e.g. FedAvg\(\), or "
                                        r"build one by name with fedpar.aggregation.build_strategy\(NAME, "):
        assembly.server(CoordinatorConfig(), "fedavg")
    with pytest.raises(TypeError, match="^server takes a fedpar.server.config.CoordinatorConfig, got dict"):
        assembly.server({"rounds": 3}, FedAvg())
    server = assembly.server(CoordinatorConfig(), build_strategy("fedavg"))
    assert server.coordinator.config.rounds == 10
    server.coordinator.close()
