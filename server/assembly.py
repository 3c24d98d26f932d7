"""Putting a coordinator together, one way for `fedpar serve`, `fedpar simulate` and the synthetic coordinator."""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import grpc
import numpy as np
import torch
from torch import nn

from fedpar.aggregation.strategy import Strategy
from fedpar.datasets import DatasetSplits
from fedpar.datasets.memory import check_fits
from fedpar.models import get_weights, weight_specs
from fedpar.parallel.device import check_device_layout, resolve_device
from fedpar.security.admission import Admission
from fedpar.server.ranks.leader import RankLeader
from fedpar.server.agent_port import AgentPort
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator, EvaluateFn, RoundCallback
from fedpar.server.members import Members
from fedpar.task import TASK_CODE_ERRORS, Task, TaskError, check_test_data, checked_task, raised
from fedpar.tasks.evaluation import TaskEvaluator
from fedpar.tasks.flower_app import FlowerApp
from fedpar.tasks.zoo import classifier_for


def synthetic_model(params: int, seed: int = 0) -> tuple[list[str], list[np.ndarray]]:
    """About ``params`` float32 parameters as a square-ish weight matrix plus a bias vector; ValueError when this
    machine's memory cannot hold them (serve --params 10^12 was a MemoryError traceback)."""
    # drawn as float64 (8 bytes a parameter), then kept as float32 (4)
    check_fits(12 * params, f"--params {params:,} (a synthetic model)", "give a smaller --params")
    width = max(1, int(np.sqrt(params)))
    rows = max(1, (params - width) // width)
    rng = np.random.default_rng(seed)
    return ["weight", "bias"], [rng.standard_normal((rows, width)).astype(np.float32) * 0.01,
                                np.zeros(width, np.float32)]


@dataclass
class CoordinatorAssembly:
    """The global model a coordinator starts from (its names and first weights), its central evaluation, the
    torch model the weights came from when there is one, and what rebuilds it (``description``, kept in
    global.json); :meth:`server` adds the rest."""

    names: list[str]
    weights: list[np.ndarray]
    evaluate: EvaluateFn | None = None
    model: nn.Module | None = None
    description: dict = field(default_factory=dict)
    run_config: dict | None = None  # a Flower App's run config, which every task carries to its ClientApps

    @classmethod
    def for_data(cls, model: str, splits: DatasetSplits, seed: int,
                 eval_device: torch.device | str | None) -> CoordinatorAssembly:
        """A ``model`` classifier sized for ``splits`` with weights drawn from ``seed``, evaluated after every
        round on ``splits.test`` on ``eval_device`` (None: not evaluated): the zoo's task (fedpar.tasks.zoo)."""
        return cls.for_task(classifier_for(model, splits), seed, eval_device)

    @classmethod
    def for_task(cls, task: Task, seed: int, eval_device: torch.device | str | None) -> CoordinatorAssembly:
        """``task``'s model with weights drawn from ``seed``, evaluated after every round with the task's evaluation
        on its test data on ``eval_device`` (None, or a task without test data: not evaluated); TaskError when its model
        or its evaluation cannot be used, ConfigurationError when the device cannot (the CLI's ``--device`` check)."""
        checked_task(task, "CoordinatorAssembly.for_task")
        if eval_device is not None:
            check_device_layout(str(eval_device))
            eval_device = resolve_device(str(eval_device))
        torch.manual_seed(seed)
        first = task.built_model()
        evaluate = None
        try:
            test_data = task.test_data() if eval_device is not None and task.test_data is not None else None
        except TASK_CODE_ERRORS as exc:  # the task's own code: one line
            raise TaskError(f"the task's test_data raised {raised(exc)}: fix the task ({task.name})") from exc
        check_test_data(task.name, test_data)
        if test_data is not None:
            evaluate = TaskEvaluator(task, test_data, device=eval_device)
            evaluate.check()  # its mistakes now, not after the first round
        return cls([name for name, _, _ in weight_specs(first)], get_weights(first), evaluate, first,
                   dict(task.description))

    @classmethod
    def for_flower_app(cls, app: FlowerApp, seed: int) -> CoordinatorAssembly:
        """The initial arrays ``app`` names in its ``[tool.fedpar] model``, drawn from ``seed``, with no central
        evaluation (the ClientApps evaluate): what fedpar's strategies start from when they drive a Flower App."""
        initial = app.initial_arrays(seed)
        return cls([name for name, _ in initial], [array for _, array in initial],
                   description={"flower_app": str(app.directory), "run_config": app.run_config},
                   run_config=app.run_config)

    def server(self, config: CoordinatorConfig, strategy: Strategy, *, on_round_end: Sequence[RoundCallback] = (),
               admission: Admission | None = None, host: str = "127.0.0.1", port: int = 0,
               credentials: grpc.ServerCredentials | None = None,
               data_tls: ssl.SSLContext | None = None, ranks: RankLeader | None = None,
               agent_port: AgentPort | None = None, members: Members | None = None) -> CoordinatorServer:
        """A Coordinator of this model and ``strategy`` behind a CoordinatorServer that is not started yet
        (ValueError when the Coordinator cannot be built, e.g. from a checkpoint of another model); on a port of its
        own, or on ``agent_port`` (a service's) with the agents of ``members`` (those of the coordinators there)."""
        if not isinstance(config, CoordinatorConfig):
            raise TypeError(f"server takes a fedpar.server.config.CoordinatorConfig, got {type(config).__name__}")
        if not isinstance(strategy, Strategy):
            raise TypeError(f"server takes a strategy object, got {type(strategy).__name__} {strategy!r}: give e.g. "
                            "FedAvg(), or build one by name with fedpar.aggregation.build_strategy(NAME, **options)")
        if self.run_config is not None:
            config = replace(config, flower_run_config=self.run_config)
        coordinator = Coordinator(config, self.names, self.weights, strategy, evaluate_fn=self.evaluate,
                                  on_round_end=on_round_end, admission=admission, ranks=ranks, members=members)
        return CoordinatorServer(coordinator, host=host, port=port, credentials=credentials, data_tls=data_tls,
                                 agent_port=agent_port)
