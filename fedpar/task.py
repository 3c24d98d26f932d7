"""Bring your own task: the model, data, training and evaluation fedpar runs, federated or central.

A :class:`Task` is plain Python: a model factory, each client's data, and either your own training hook or the
built-in loop (your loss, optimizer and batches), and an evaluation returning named metrics. The command line
loads one by reference (``--task package.module:factory`` or ``--task path/to/file.py:factory``), calling the
factory with the ``--task-option KEY=VALUE`` pairs. The built-in models (mlp/cnn on digits, mnist and tables)
are tasks too (``fedpar.tasks.zoo``). A client's training stops by the :class:`Deadline` it is given, set by the client
side's one deadline rule (:func:`stop_training_at`, :func:`upload_ends_at`).

This module imports neither torch nor anything else heavy: the command line reads it to build its parsers.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedpar.settings import DEFINES, check_type, setting

if TYPE_CHECKING:
    import torch
    from torch import nn


# What the task's own code may raise that is its failure: any exception, and a sys.exit() in it (said in one line as
# they are; a KeyboardInterrupt may be the user's Ctrl-C: is_task_failure tells)
TASK_CODE_ERRORS = (Exception, SystemExit)


def is_task_failure(exc: BaseException) -> bool:
    """Whether ``exc``, out of the task's own code, is its failure: one of TASK_CODE_ERRORS, or a KeyboardInterrupt
    no Ctrl-C raised: off the main thread (where no signal arrives), or while SIGINT's handler is not Python's default
    (the only one that raises a plain KeyboardInterrupt; fedpar's stop raises its own kind, StopRequested)."""
    if isinstance(exc, TASK_CODE_ERRORS):
        return True
    return type(exc) is KeyboardInterrupt and (threading.current_thread() is not threading.main_thread()
                                               or signal.getsignal(signal.SIGINT) is not signal.default_int_handler)


class TaskError(ValueError):
    """A task that cannot be run as it is, with the line that says what to change."""

    exit_code = 2  # refused before anything ran


class TaskFailed(TaskError):
    """The task's own code raised while the run went on (e.g. its central evaluation): the run stops, its one line
    says so."""

    exit_code = 1  # as a run whose every round failed


def raised(exc: BaseException) -> str:
    """What the task's own code raised, in one line: 'TypeError: the first line of its message'."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@dataclass(frozen=True)
class Partition:
    """Which share of the data a client holds: share ``index`` of ``count``, and how the shares are drawn.

    ``scheme`` (iid, dirichlet:ALPHA, shards:N: the ``--partition`` option), ``seed`` (the same on every client)
    and ``val_fraction`` (the share of a client's examples kept for federated evaluation) are suggestions a
    task may follow, as :func:`fedpar.tasks.share_of` does, or ignore.
    """

    index: int = 0
    count: int = 1
    client_id: str = ""
    scheme: str = "iid"
    seed: int = 0
    val_fraction: float = 0.1

    def __post_init__(self) -> None:
        for name, kind in (("index", int), ("count", int), ("client_id", str), ("scheme", str), ("seed", int),
                           ("val_fraction", float)):
            check_type(kind, getattr(self, name), f"Partition's {name}")
        if not 0 <= self.index < self.count:
            raise TaskError(f"partition index {self.index} is not in [0, {self.count})")
        if not 0 <= self.val_fraction < 1:
            raise TaskError(f"Partition's val_fraction must be in [0, 1) (some examples must train), got "
                            f"{self.val_fraction!r}")


@dataclass
class ClientData:
    """One client's local data: a training set and, optionally, a validation set for federated evaluation.

    Both are map-style datasets (``len`` and indexing: a ``torch.utils.data.Dataset``, ``TensorDataset``, or
    ``fedpar.datasets.ArrayDataset``); the built-in loop batches them with the task's ``loader``.
    """

    train: Any
    val: Any = None


@dataclass(frozen=True)
class LocalConfig:
    """What the coordinator asks of one local training run (the round's task), as a ``Task.train`` hook sees it."""

    epochs: int
    batch_size: int
    learning_rate: float
    round: int = 0
    seed: int = 0  # this client's shuffling seed
    proximal_mu: float = 0.0  # FedProx: the built-in loop adds mu/2 * ||w - w_global||^2 to the loss
    max_steps: int | None = None
    device: Any = "cpu"  # the torch.device the model lives on


class StepClock:
    """Smoothed wall time of one local step: the first step of a run sets it, each later one moves it a fifth of
    the way to its own time. Between runs it keeps the last estimate, for the next run's first deadline test."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._fresh = True

    def restart(self) -> None:
        """Let the next measured step replace the estimate (a new run: the data or the load may have changed)."""
        self._fresh = True

    def measured(self, seconds: float) -> None:
        """Fold one step's wall time into the estimate."""
        self.seconds = seconds if self._fresh else 0.8 * self.seconds + 0.2 * seconds
        self._fresh = False

    def fits(self, stop_at: float, extra: float = 0.0) -> bool:
        """Whether one more step, and ``extra`` seconds after it, would end by ``time.monotonic()`` ``stop_at``."""
        return time.monotonic() + self.seconds + extra <= stop_at


class Deadline:
    """When local training must have returned (``at``, a ``time.monotonic()`` value), and a loop that keeps to it.

    ``for batch in deadline.steps(batches): ...`` yields batches for as long as one more step, timed like the
    ones before it, still ends in time; ``stopped_early`` then says whether it cut the loop short and ``taken``
    counts the steps it let through. fedpar's built-in loop uses it too.
    """

    def __init__(self, at: float = math.inf, wait: Callable[[], None] | None = None, clock: StepClock | None = None):
        """A deadline at ``time.monotonic()`` value ``at``. ``wait``: called before each clock read to let the work
        queued on the model's device finish (fedpar passes a GPU synchronize there: the clock must see queued GPU
        work, or the deadline is missed). ``clock``: the step clock to time steps with (a trainer keeps one across
        runs, so that the first test of a run already knows how long a step takes); default: a fresh one."""
        self.at = at
        self.stopped_early = False
        self.taken = 0
        self.wait = wait
        self.clock = clock if clock is not None else StepClock()

    def remaining(self) -> float:
        """Seconds left."""
        return self.at - time.monotonic()

    def steps(self, batches: Iterable) -> Iterator:
        """``batches``, one at a time, while the next step still fits before the deadline."""
        clock = self.clock
        clock.restart()
        for batch in batches:
            if self.wait is not None:
                self.wait()
            if not clock.fits(self.at):
                self.stopped_early = True
                return
            start = time.monotonic()
            yield batch
            if self.wait is not None:
                self.wait()
            self.taken += 1
            clock.measured(time.monotonic() - start)



# The client side's one deadline rule: when a member must stop training and upload. A member expects its upload to
# take UPLOAD_TO_DOWNLOAD times what the round's download took, and keeps UPLOAD_MARGIN_SECONDS more free before the
# task's deadline (the training's Deadline is at stop_training_at); its upload, asked as it starts, must be over by
# the deadline plus slack for the reply (upload_ends_at), a value the upload's calls take their timeouts from. The
# client runtime asks it on the real clock; a simulation's virtual clock (simulations/population.py) on simulated
# seconds. The server's side is server/deadline.py.
UPLOAD_TO_DOWNLOAD = 1.2  # a member expects its upload to take this many times its download
UPLOAD_MARGIN_SECONDS = 0.25  # ... and keeps this much more free before the deadline
UPLOAD_REPLY_SECONDS = 5.0  # an upload's calls may run this long past the deadline, for the reply


def stop_training_at(deadline_at: float, download_seconds: float,
                     margin_seconds: float = UPLOAD_MARGIN_SECONDS) -> float:
    """The time (on the deadline's clock) by which training must end for the upload to arrive in time."""
    return deadline_at - UPLOAD_TO_DOWNLOAD * download_seconds - margin_seconds


def steps_in_time(steps: int, step_seconds: float, download_seconds: float, deadline_seconds: float) -> int:
    """How many of ``steps`` local steps of ``step_seconds`` each fit between a download of ``download_seconds``
    (started at 0) and the moment :func:`stop_training_at` says training must end, ``deadline_seconds`` after 0."""
    if step_seconds <= 0:
        return steps
    room = stop_training_at(deadline_seconds, download_seconds) - download_seconds
    return min(steps, int(max(0.0, room) // step_seconds))


def upload_ends_at(deadline_at: float) -> float:
    """When an upload that starts now must be over, its retries and their replies included (a time.monotonic()
    value): the round's deadline plus slack for the reply; past the deadline, one short last try."""
    return max(deadline_at, time.monotonic()) + UPLOAD_REPLY_SECONDS


def checked_task(task: Any, where: str) -> Task:
    """``task``, given to ``where`` (the call a program made): TypeError unless it is a Task; TaskError as
    :meth:`Task.check` says (the checks ``--task`` makes as it loads one)."""
    if not isinstance(task, Task):
        raise TypeError(f"{where} takes a fedpar.Task, got {type(task).__name__}: build one with "
                        "fedpar.Task(model=..., client_data=..., ...) or fedpar.tasks.reference.load_task(REF)")
    task.check()
    return task


def checked_client_data(data: Any, given: str = "client_data must return") -> ClientData:
    """``data``, what a task's ``client_data`` returned (or what ``given``, the start of the message, says it is);
    TaskError unless it is a ClientData of datasets."""
    if not isinstance(data, ClientData):
        raise TaskError(f"{given} fedpar.ClientData(train, val), got {type(data).__name__}")
    check_dataset("client_data's ClientData.train", data.train)
    check_dataset("client_data's ClientData.val", data.val)
    return data


def check_dataset(what: str, value: Any) -> None:
    """TaskError, naming ``what``, when ``value`` holds its examples as columns (a dict, or a pair of arrays such as
    (inputs, targets)), not as the items of a dataset."""
    pair = (isinstance(value, (tuple, list)) and len(value) == 2
            and all(len(getattr(a, "shape", ())) >= 1 for a in value) and value[0].shape[0] == value[1].shape[0])
    if isinstance(value, dict) or pair:
        raise TaskError(f"{what} is a {type(value).__name__} of arrays, not a dataset of examples: give "
                        "TensorDataset(inputs, targets) (torch.utils.data)")
    data = sys.modules.get("torch.utils.data")  # loaded already where a DataLoader was made
    if data is not None and isinstance(value, data.DataLoader):
        raise TaskError(f"{what} is a DataLoader, which batches a dataset, not the dataset: give its dataset "
                        "(loader.dataset); fedpar batches it (a task's loader(dataset, batch_size, generator) says "
                        "how)")


def check_training_data(task_name: str, data: ClientData, whose: str = "") -> None:
    """TaskError, in one line, when a task's client data (``whose``: which client's, e.g. 'partition 2 of 8') holds
    no training examples."""
    if data.train is None or not len(data.train):
        raise TaskError(f"task {task_name!r}: client_data gave no training examples{f' for {whose}' if whose else ''}")


def check_test_data(task_name: str, dataset: Any) -> None:
    """TaskError, in one line, when a task's test_data() gave a dataset of no examples (None: no central evaluation,
    as meant; an empty one ran without it, unsaid)."""
    if dataset is not None and hasattr(dataset, "__len__") and not len(dataset):
        raise TaskError(f"task {task_name!r}: test_data() gave a dataset of no examples: return the held-out examples, "
                        "or None for no central evaluation")


TrainHook = Callable[["nn.Module", ClientData, LocalConfig, Deadline], "tuple[int, dict[str, float]]"]
EvaluateHook = Callable[["nn.Module", Any], "dict[str, float]"]


@dataclass
class Task:
    """A model, its data and how to train and score it: what ``fedpar simulate|serve|client|train --task`` runs.

    - ``model()``: a fresh ``torch.nn.Module`` (the same architecture every call); its floating-point
      ``state_dict`` entries are the weights the coordinator averages.
    - ``client_data(partition)``: the :class:`ClientData` of one client (``Partition(0, 1)`` holds everything:
      ``fedpar train`` trains on that).
    - ``test_data()``: the held-out set the coordinator (and ``fedpar train``) evaluates on; None: no central
      evaluation.
    - Training, either ``train(model, data, config, deadline) -> (examples, metrics)``, your own loop (use
      ``deadline.steps(batches)`` to stop in time; ``examples`` counts the examples trained on, each time seen, and
      weighs the update), or the built-in loop: ``loss(model(inputs), targets)`` over the batches of
      ``loader(dataset, batch_size, generator)`` (default: shuffled batches of (inputs, targets)), stepped by
      ``optimizer(parameters, lr)`` (default: plain SGD at the round's learning rate), epoch after epoch until the
      deadline. The loop calls the optimizer's ``step()`` once per batch, without a closure: an optimizer whose
      step needs one (``torch.optim.LBFGS``) is refused when the task loads; step it in your own ``train``.
    - ``evaluate(model, dataset) -> {name: value}``: named metrics (the built-in one: the mean ``loss``, and
      ``accuracy`` when the model outputs class scores for integer labels). Central evaluation reports them as
      ``test_NAME``, agents on their validation sets as ``federated_eval_NAME``.
    - ``tp_plan(model) -> {module name: ParallelStyle}``: how ``--tp`` splits the model, a
      ``torch.distributed.tensor.parallel`` plan (e.g. ``{"0": ColwiseParallel(), "2": RowwiseParallel()}``) that
      the engine applies with ``parallelize_module``; None: the task does not take ``--tp``. The model must then
      reshape with ``-1`` wherever a split width shows (each rank holds its share of the heads or features).

    On the engine (``client --nproc``, ``train --nproc``/``--fsdp``/``--tp``) the built-in loop's ``loss`` is taken
    to be the mean over the batch's examples (torch's default reduction): each rank weighs its share of a batch
    by its examples, so the ranks together step as one process does on the whole batch.
    """

    model: Callable[[], nn.Module]
    client_data: Callable[[Partition], ClientData]
    test_data: Callable[[], Any] | None = None
    train: TrainHook | None = None
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    optimizer: Callable[[list, float], Any] | None = None
    loader: Callable[[Any, int, torch.Generator], Iterable] | None = None
    evaluate: EvaluateHook | None = None
    tp_plan: Callable[[nn.Module], dict] | None = None
    name: str = "task"
    description: dict = field(default_factory=dict)  # what rebuilds the model, kept in global.json
    _layout: list | None = field(default=None, init=False, repr=False, compare=False)  # the first model()'s weights

    def check(self) -> None:
        """TaskError naming what is missing or of the wrong kind."""
        problems = []
        for name in ("model", "client_data"):
            if not callable(getattr(self, name)):
                problems.append(f"{name} must be a function (got {type(getattr(self, name)).__name__})")
        if _is_module(self.model):  # callable, but one shared model where a fresh one is needed each call
            problems.append(f"{MODEL_FACTORY}, got the module {type(self.model).__name__} itself")
        for name in OPTIONAL_HOOKS:
            value = getattr(self, name)
            if value is not None and not callable(value):
                problems.append(f"{name} must be a function or None (got {type(value).__name__})")
        if _is_module_class(self.loss):  # loss=nn.CrossEntropyLoss: called on a batch, it builds a module
            name = self.loss.__name__
            problems.append(f"loss is the class {name}, which makes a loss module: give one, loss=nn.{name}() (or a "
                            "function such as nn.functional.cross_entropy)")
        if self.train is None and self.loss is None:
            problems.append("it needs a loss(outputs, targets) for the built-in loop, or its own train(model, data, "
                            "config, deadline) hook")
        if self.evaluate is None and self.loss is None:
            problems.append("it needs an evaluate(model, dataset) returning named metrics, or a loss the built-in "
                            "evaluation can average")
        if self.train is None and callable(self.optimizer):
            problems += self._optimizer_problems()
        problems += self._methods_not_called()
        if problems:
            raise TaskError(f"task {self.name!r}: " + "; ".join(problems))

    def built_model(self) -> nn.Module:
        """``model()``, checked: TaskError unless it is an nn.Module with floating-point parameters that fedpar can
        exchange, whose weights have the names, dtypes and shapes of the first model it made."""
        import torch
        from torch import nn

        from fedpar.models.weights import weight_specs

        try:
            model = self.model()
        except TASK_CODE_ERRORS as exc:  # the task's own code: one line
            raise TaskError(f"task {self.name!r}: model() raised {raised(exc)}") from exc
        if not isinstance(model, nn.Module):
            raise TaskError(f"task {self.name!r}: {MODEL_FACTORY}; model() returned a {type(model).__name__}")
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
            raise TaskError(f"task {self.name!r}: model() has lazy parameters of no shape yet (nn.LazyLinear, ...), "
                            "but the coordinator needs the weights' shapes before any data: give those layers their "
                            "input sizes (nn.Linear(in_features, out_features))")
        if not any(torch.is_floating_point(p) for p in model.parameters()):
            raise TaskError(f"task {self.name!r}: model() has no floating-point parameters: nothing to train or "
                            "average")
        try:
            layout = weight_specs(model)
        except ValueError as exc:  # e.g. bfloat16 weights: the wire's numpy arrays cannot hold them
            raise TaskError(f"task {self.name!r}: model()'s {exc}") from None
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:  # every process and seat calls model(): all must make the coordinator's weights
            raise TaskError(f"task {self.name!r}: model() made other weights than on its first call "
                            f"({first_difference(layout, self._layout)}); it must build the same model every call "
                            "(no sizes drawn at random)")
        return model

    def batch_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """``loss(outputs, targets)``, checked to be one number (a 0-dim tensor): TaskError saying how to make it
        one."""
        value = self.loss(outputs, targets)
        if getattr(value, "ndim", None) != 0:
            got = f"shape {list(value.shape)}" if hasattr(value, "shape") else f"a {type(value).__name__}"
            raise TaskError(f"task {self.name!r}: loss(outputs, targets) must return the batch's mean loss as a 0-dim "
                            f"tensor, got {got}: reduce it (.mean(), or torch's default reduction='mean')")
        return value

    def data_for(self, partition: Partition) -> ClientData:
        """``client_data(partition)``, checked: TaskError, in one line, when it raises, returns anything but a
        ClientData, or holds no training examples."""
        try:
            data = self.client_data(partition)
        except BaseException as exc:  # the task's own code: one line (a Ctrl-C: raised on)
            if not is_task_failure(exc):
                raise
            raise TaskError(f"the task's client_data raised {raised(exc)} for partition {partition.index} of "
                            f"{partition.count}: fix the task ({self.name})") from exc
        check_training_data(self.name, checked_client_data(data), f"partition {partition.index} of {partition.count}")
        return data

    def _methods_not_called(self) -> list[str]:
        """Hooks a subclass wrote as methods where the field of that name is unset: fedpar calls the fields, so such a
        method would be silently left out (the built-in loop trained in place of a subclass's own train)."""
        problems = []
        for name in OPTIONAL_HOOKS:
            if getattr(self, name) is not None:
                continue
            defined = next((cls for cls in type(self).__mro__[:type(self).__mro__.index(Task)]
                            if callable(vars(cls).get(name))), None)
            if defined is not None:
                problems.append(f"{defined.__name__} defines {name}() as a method, which fedpar does not call (a "
                                f"Task's hooks are its fields): give it as one, {type(self).__name__}(..., "
                                f"{name}=FUNCTION)")
        return problems

    def _optimizer_problems(self) -> list[str]:
        """Why the built-in loop cannot step what ``optimizer`` makes (it calls ``step()`` once per batch, with no
        closure), made for one stand-in parameter; none when the factory needs the model's own parameters (its
        training then says what is wrong)."""
        import inspect

        import torch

        try:
            optimizer = self.optimizer([torch.zeros(1, requires_grad=True)], 0.1)
        except Exception:
            return []
        step = getattr(optimizer, "step", None)
        if not callable(step):
            return [f"optimizer(parameters, lr) must return a torch optimizer (one with step()), got a "
                    f"{type(optimizer).__name__}"]
        try:
            closure = inspect.signature(step).parameters.get("closure")
        except (TypeError, ValueError):  # a step whose signature cannot be read: stepping it says what is wrong
            return []
        if closure is not None and closure.default is inspect.Parameter.empty:
            return [f"its optimizer is a {type(optimizer).__name__}, whose step() needs a closure that evaluates the "
                    "loss again; the built-in loop steps the optimizer once per batch without one: use another "
                    "optimizer (SGD, Adam, AdamW, ...), or step this one with a closure in your own train(model, "
                    "data, config, deadline) hook"]
        return []


OPTIONAL_HOOKS = ("test_data", "train", "loss", "optimizer", "loader", "evaluate", "tp_plan")  # a Task's, None: unset
MODEL_FACTORY = "model must be a function returning an nn.Module (write model=lambda: ...)"


def first_difference(layout: list, first: list, first_is: str = "the first had") -> str:
    """Where ``layout`` (weight_specs of a model) first differs from ``first``'s, in a few words (``first_is`` says
    whose ``first`` is: 'the first had', 'model() made')."""
    for (name, dtype, shape), (name0, dtype0, shape0) in zip(layout, first):
        if (name, dtype, shape) != (name0, dtype0, shape0):
            return f"{name!r} {dtype} {shape}, where {first_is} {name0!r} {dtype0} {shape0}"
    return f"{len(layout)} weights, where {first_is} {len(first)}"


def _is_module_class(value: Any) -> bool:
    """Whether ``value`` is a torch module's class (torch is not imported for it, as for :func:`_is_module`)."""
    nn = sys.modules.get("torch.nn")
    return nn is not None and isinstance(value, type) and issubclass(value, nn.Module)


def _is_module(value: Any) -> bool:
    """Whether ``value`` is a torch module (torch is not imported for it: a module's class is torch's already)."""
    nn = sys.modules.get("torch.nn")
    return nn is not None and isinstance(value, nn.Module)


@dataclass
class TaskReference:
    """Which task a command runs: ``--task`` and its ``--task-option KEY=VALUE`` pairs (declared once here)."""

    task: str | None = setting(
        None, group="data", metavar="REF",
        help="your own task: package.module:factory or path/to/file.py:factory, a function returning a fedpar.Task "
             "(see docs/tutorials/your-own-task.md); it replaces --model and --dataset", resume=DEFINES)
    task_options: dict = setting(default_factory=dict, flag="task-option", metavar="KEY=VALUE", group="data",
                                 help="an option of --task, given to its factory (repeatable), typed as the factory "
                                      "declares it; none (any case) gives None to an option declared X | None",
                                 resume=DEFINES)


@dataclass
class FlowerAppReference:
    """Which Flower App a command runs: ``--flower-app DIR`` and its ``--run-config`` overrides (declared once here)."""

    flower_app: str | None = setting(
        None, group="data", metavar="DIR",
        help="a Flower App project directory (pyproject.toml with [tool.flwr.app.components]): its ClientApp trains "
             "the members; with --strategy, fedpar's strategy aggregates (the initial arrays come from "
             "[tool.fedpar] model = 'module:factory'); needs pip install 'fedpar[flower]'", resume=DEFINES)
    run_config: str | None = setting(
        None, group="data", metavar="'KEY=VALUE ...'",
        help="with --flower-app: overrides of the app's [tool.flwr.app.config], as flwr run --run-config takes them "
             "(TOML values, space-separated; or a .toml file)", resume=DEFINES)
