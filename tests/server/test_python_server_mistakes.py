"""A coordinator built in Python and used wrongly says what to do (QA): an evaluation device torch cannot use gets
the CLI's --device message, and a CoordinatorServer asked for its address or waited on before start(), or started
again after stop(), says so instead of '127.0.0.1:None', a silent False or 'the coordinator is not running'."""

from __future__ import annotations

import pytest
import torch

from fedpar.aggregation import FedAvg
from fedpar.parallel.config import ConfigurationError
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.config import CoordinatorConfig
from fedpar.tasks.zoo import classifier


@pytest.fixture(scope="module")
def task():
    return classifier(model="mlp", dataset="digits")


def test_an_eval_device_without_a_gpu_gets_the_clis_message(task, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigurationError, match="needs a CUDA GPU, but torch sees none.*use --device cpu"):
        CoordinatorAssembly.for_task(task, seed=0, eval_device="cuda")
    with pytest.raises(ConfigurationError, match="'gpu' is not a device; use auto, cpu, cuda or cuda:N"):
        CoordinatorAssembly.for_task(task, seed=0, eval_device="gpu")
    assembly = CoordinatorAssembly.for_task(task, seed=0, eval_device=torch.device("cpu"))
    assert assembly.evaluate is not None


def test_a_server_used_before_start_or_after_stop_says_what_to_do(task):
    assembly = CoordinatorAssembly.for_task(task, seed=0, eval_device=None)
    server = assembly.server(CoordinatorConfig(rounds=1, clients_per_round=1, min_available=1), FedAvg())
    with pytest.raises(RuntimeError, match=r"not started.*call start\(\) first"):
        server.address
    with pytest.raises(RuntimeError, match=r"not started.*call start\(\) first"):
        server.wait(1)
    server.start()
    try:
        assert server.address == f"127.0.0.1:{server.port}"
        assert server.wait(0.1) is False
        with pytest.raises(RuntimeError, match="started already"):
            server.start()
    finally:
        server.stop()
    with pytest.raises(RuntimeError, match=r"stopped coordinator server cannot start again: build a new one with "
                                           r"CoordinatorAssembly"):
        server.start()
