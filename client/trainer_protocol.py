"""What the client runtime asks of a member's trainer: the one protocol every trainer implements (the task trainer,
the stacked members' trainer, the engine agent's, a Flower client's)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from fedpar.client.local_loop import TrainResult
from fedpar.protocol.task_settings import TaskSettings
from fedpar.tasks.evaluation import EvalResult

Spec = tuple[str, str, tuple[int, ...]]  # (name, dtype, shape) of one array of the model


class UpdateRefused(Exception):
    """A member's training that made no update the runtime may send (e.g. a Flower ClientApp's reply of the wrong
    shape): the runtime notes the reason among the round's refusals and goes on without the update."""


class CalledOff(Exception):
    """A member's training cut short because its runtime is stopping (the run is over, or a signal came): there is
    no update and nothing to tell."""


@runtime_checkable
class Trainer(Protocol):
    """A member's local training, as the runtime drives it: Join declares ``framework`` and ``num_examples``; each
    task loads the global arrays, holds the task while it runs, evaluates, trains and reads the arrays back."""

    framework: ClassVar[str]  # what the member runs ("torch", "flower"), declared at Join
    reads_task_settings: ClassVar[bool]  # train() takes the task's settings (``settings=``), e.g. a Flower fit config
    # evaluate_splits scores other members' validation splits (a host's members of a round, in one pass)
    evaluates_together: ClassVar[bool]
    # a train() (or evaluate) that raised leaves it fit for the next task: the runtime tells the coordinator that the
    # member's task failed and goes on (False: the error ends the runtime, as an engine's ranks stop together)
    survives_failed_training: ClassVar[bool]

    @property
    def num_examples(self) -> int:
        """Size of the local training set (declared at Join: it bounds the example counts the member may claim)."""

    def array_specs(self) -> list[Spec]:
        """(name, dtype, shape) of the model's arrays, in the order the coordinator exchanges them."""

    def set_arrays(self, arrays: list[np.ndarray]) -> None:
        """Load the round's global weights."""

    def get_arrays(self) -> list[np.ndarray]:
        """The weights after training (what is uploaded; the runtime may hold them until its upload goes, so the
        trainer must not write them afterwards: a copy, or memory nothing changes any more)."""

    def warm_up(self) -> None:
        """Pay lazy set-up (first passes, imports) before any deadline runs; the weights do not change."""

    def holding_task(self, round_id: int) -> contextlib.AbstractContextManager:
        """The span in which the member holds a task of ``round_id`` (a stacked trainer waits for its holders)."""

    def call_off(self) -> None:
        """The runtime is stopping: end any wait of the current training now (it then raises CalledOff)."""

    def tasks_queued(self, round_id: int, count: int) -> None:
        """``count`` of the runtime's tasks of ``round_id`` were queued for its seats (negative: dropped unstarted),
        told to its first seat's trainer before any seat may take them; a seat takes one as it enters
        :meth:`holding_task` (stacked trainers, which share what they count, wait for them)."""

    def evaluate(self, settings: TaskSettings | None = None) -> EvalResult | None:
        """Metrics of the current weights on the local validation split (None without one; ``settings``: the
        task's, passed when ``reads_task_settings``)."""

    def evaluate_splits(self, splits: Sequence[Any]) -> list[EvalResult | None]:
        """Metrics of the current weights on each of ``splits`` (members' validation splits; None for an empty or
        missing one), as :meth:`evaluate` gives them for a member's own; only when ``evaluates_together``."""

    def train(self, epochs: int, batch_size: int, lr: float, stop_at: float = math.inf, proximal_mu: float = 0.0,
              round_id: int = 0, max_steps: int | None = None,
              settings: TaskSettings | None = None) -> TrainResult:
        """Train for ``epochs`` (at most ``max_steps`` steps) or until ``time.monotonic()`` would pass ``stop_at``
        (``settings``: the task's, passed when ``reads_task_settings``); UpdateRefused when it made no update."""


class HeldArrays:
    """The protocol's array hand-over for a trainer that calls someone else's code with the global arrays (a Flower
    client or ClientApp): it holds the round's global arrays, the trained ones and the task's round."""

    evaluates_together = False  # the client evaluates its own data only
    survives_failed_training = True
    _global: list[np.ndarray] | None = None
    _trained: list[np.ndarray] | None = None
    _round = 0

    def set_arrays(self, arrays: list[np.ndarray]) -> None:
        """The round's global arrays (passed to the client's handlers)."""
        self._global = arrays
        self._trained = None

    def get_arrays(self) -> list[np.ndarray]:
        """The arrays of the last accepted training reply."""
        if self._trained is None:
            raise RuntimeError("get_arrays() before a training reply in this task")
        return self._trained

    def warm_up(self) -> None:
        """Nothing: the client sets itself up in its own handlers."""

    def evaluate_splits(self, splits: Sequence[Any]) -> list[EvalResult | None]:
        """Not possible: the client's evaluate handler sees only its own data (``evaluates_together`` is False)."""
        raise TypeError(f"{type(self).__name__} evaluates its own data only; call evaluate()")

    def holding_task(self, round_id: int) -> contextlib.AbstractContextManager:
        """Remember the task's round (the client's configs name it)."""
        self._round = int(round_id)
        return contextlib.nullcontext()

    def tasks_queued(self, round_id: int, count: int) -> None:
        """Nothing: each member trains on its own."""

    def call_off(self) -> None:
        """Nothing: the client's handlers do not wait on the runtime."""
