"""The one local-training loop: a member's batches, one step after another, until its schedule ends or its deadline
would pass. It runs one member on a model (client/task_trainer.py), one engine agent on its ranks
(client/engine_trainer.py), or the members a worker trains at once, stacked (client/batched_trainer.py).

Written here once: the batch schedule (each epoch a fresh shuffle of the member's examples, cut into batches, capped
at ``max_steps``), the deadline rule (before a step: would it, with the member's simulated delay, pass its
``stop_at``?), the objective (the task's batch-mean loss plus FedProx's proximal term) and the update (the task's
optimizer, else torch's plain SGD, :func:`sgd_step`), and what a run did (:class:`TrainResult`, the honest basis of
the update's FedAvg weight). A :class:`Stepper` only says how one step of the members still training is computed,
and counts what they trained on.
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.sgd import sgd

from fedpar.aggregation.fedprox import add_proximal_gradient, proximal_term
from fedpar.task import StepClock
from fedpar.tasks.data import default_batches


@dataclass(frozen=True, eq=False)
class StackRow:
    """A member's trained weights as row ``row`` of members' weights stacked together: ``stacked`` holds one
    (members, *shape) array per tensor, in the trainer's array order; rows of one ``source`` (the stack) may be summed
    with one op over it."""

    source: object
    stacked: tuple[Any, ...]  # numpy arrays
    row: int

    def holds(self, arrays: Sequence[Any]) -> bool:
        """Whether ``arrays`` are this row's own memory (views of it, not copies or changed weights)."""
        return len(arrays) == len(self.stacked) and all(
            a.shape == x.shape[1:] and a.dtype == x.dtype and a.strides == x.strides[1:]
            and a.__array_interface__["data"][0] == x[self.row].__array_interface__["data"][0]
            for a, x in zip(arrays, self.stacked))


@dataclass
class TrainResult:
    """What one local training run did: the honest basis of the update's FedAvg weight."""

    steps: int
    examples: int  # examples actually trained on (counted once per epoch they were seen in)
    loss: float
    stopped_early: bool
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)  # other named metrics (a task's own training)
    rows: StackRow | None = None  # where the trained weights are one row of members' stacked weights, if they are

    def as_metrics(self) -> dict[str, float]:
        """What an agent reports of it: train_seconds, train_loss and train_NAME, where finite."""
        named = {"loss": self.loss, **self.metrics, "seconds": self.seconds}
        return {f"train_{k}": float(v) for k, v in named.items() if math.isfinite(v)}


@dataclass
class StepTally:
    """Steps taken so far, the examples they trained on, the sum of their losses, and whether a deadline stopped
    them (``loss_sum`` may be a tensor, so that counting does not wait for the device)."""

    steps: int = 0
    examples: int = 0
    loss_sum: float | torch.Tensor = 0.0
    stopped: bool = False

    def result(self, seconds: float) -> TrainResult:
        """The TrainResult of these steps: the mean loss per example (NaN when none was trained on)."""
        loss = float(self.loss_sum) / self.examples if self.examples else math.nan
        return TrainResult(self.steps, self.examples, loss, self.stopped, seconds)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters SGD updates."""
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def sgd_step(params: list[nn.Parameter], lr: float) -> None:
    """Plain SGD on the parameters that have a gradient, with torch.optim.SGD's own update function.

    The functional form skips the Optimizer object, whose first construction in a process imports
    torch._dynamo (about 1.2 s of CPU here, paid again by every simulation worker process); the arithmetic
    is the one ``torch.optim.SGD(params, lr).step()`` runs.
    """
    with_grad = [p for p in params if p.grad is not None]
    if with_grad:
        sgd(with_grad, [p.grad for p in with_grad], [None] * len(with_grad), weight_decay=0.0, momentum=0.0, lr=lr,
            dampening=0.0, nesterov=False, maximize=False)


def member_seed(seed: int, agent_id: str) -> int:
    """The data-order seed of member ``agent_id`` in a run seeded ``seed``: the one derivation a deployed agent
    (``fedpar client --seed SEED --agent-id ID``) and a simulated member of the same id both train by."""
    return seed + zlib.crc32(agent_id.encode()) % 10_000


def shuffling_generator(seed: int, round_id: int) -> torch.Generator:
    """The generator of a member's batch order in round ``round_id``: one ``torch.randperm`` per epoch."""
    return torch.Generator().manual_seed(seed * 1_000_003 + round_id)


@contextlib.contextmanager
def member_draws(seed: int, round_id: int, device: torch.device) -> Iterator[None]:
    """torch's own random draws inside the block (a model's dropout, a task hook's torch.rand) from member ``seed``'s
    stream of round ``round_id``, as a deployed agent of its id draws them whatever this process ran before; the
    process's streams are put back after. Apart from the batch order's (:func:`shuffling_generator`)."""
    with kept_draws(device) as generators:
        for g in generators:
            g.manual_seed((seed * 1_000_003 + round_id) ^ DRAWS_STREAM)
        yield


@contextlib.contextmanager
def kept_draws(device: torch.device) -> Iterator[list[torch.Generator]]:
    """The generators a member's training on ``device`` draws from (:func:`draw_generators`), their states put back
    as they were when the block ends."""
    generators = draw_generators(device)
    kept = [g.get_state() for g in generators]
    try:
        yield generators
    finally:
        for g, state in zip(generators, kept):
            g.set_state(state)


def draw_generators(device: torch.device) -> list[torch.Generator]:
    """The generators a member's training on ``device`` draws from: the CPU's, and the device's own on a GPU. The
    generators themselves, seeded and kept directly: torch.random.fork_rng and torch.manual_seed visit every backend,
    0.29 ms a member (a tenth of the plain loop's whole 10-member round), against 2 us."""
    generators = [torch.default_generator]
    if device.type == "cuda":
        generators.append(torch.cuda.default_generators[device.index if device.index is not None
                                                        else torch.cuda.current_device()])
    return generators


DRAWS_STREAM = 0x5EED  # keeps a member's torch draws off its batch order's stream of the same seed and round


def member_orders(n: int, epochs: int, seed: int, round_id: int) -> Iterator[torch.Tensor]:
    """The order of a member's ``n`` examples in each of its ``epochs`` of round ``round_id``, as
    :func:`member_batches` draws them (the engine agent cuts these over its ranks)."""
    generator = shuffling_generator(seed, round_id)
    for _ in range(epochs):
        yield torch.randperm(n, generator=generator)


def stacked_schedules(sizes: list[int], seeds: list[int], epochs: int, batch_size: int,
                      round_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every stacked member's batches (those :func:`member_batches` gives it) at once, over their examples laid end
    to end (member k's first is ``sum(sizes[:k])``): (members, longest schedule, batch_size) indices and the mask of
    the real ones; the last batch of an epoch is padded at its end, and a schedule's padding (and a shorter member's
    missing steps) point at the member's first example. One ``randperm`` per member and epoch, drawn as its own loop
    draws them; the rest is tensor ops."""
    if sizes:  # a batch above every member's size is each member's whole epoch: pad to the largest, not to it
        batch_size = max(1, min(batch_size, max(sizes)))
    sizes_t = torch.tensor(sizes, dtype=torch.long)
    per_epoch = (sizes_t + batch_size - 1) // batch_size
    width = per_epoch * batch_size  # a member's padded epoch
    longest = int(per_epoch.max()) * epochs if sizes else 0
    firsts = torch.cumsum(sizes_t, 0) - sizes_t
    index = firsts.view(-1, 1).repeat(1, longest * batch_size)
    mask = torch.zeros(len(sizes), longest * batch_size, dtype=torch.bool)
    perms = []
    for n, seed in zip(sizes, seeds):
        perms += member_orders(n, epochs, seed, round_id)
    if perms:
        # the flat position of each real example: its member's row, its epoch's start, its place in the epoch
        counts = sizes_t.repeat_interleave(epochs)
        rows = torch.arange(len(sizes)).repeat_interleave(epochs).repeat_interleave(counts)
        starts = (torch.arange(epochs).repeat(len(sizes)) * width.repeat_interleave(epochs))
        within = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
        columns = starts.repeat_interleave(counts) + within
        index[rows, columns] = torch.cat(perms) + firsts[rows]
        mask[rows, columns] = True
    return (index.view(len(sizes), longest, batch_size), mask.view(len(sizes), longest, batch_size))


def member_batches(dataset: Any, batch_size: int, epochs: int, seed: int, round_id: int,
                   loader: Callable | None = None) -> Iterator:
    """The batches one member trains on, in order: each epoch a fresh shuffle of its examples by its own generator
    (:func:`shuffling_generator`), cut into batches by the task's ``loader`` or :func:`default_batches` (the stacked
    members' are :func:`stacked_schedules`, the same batches)."""
    generator = shuffling_generator(seed, round_id)
    for _ in range(epochs):
        yield from (loader or default_batches)(dataset, batch_size, generator)


def objective(loss: torch.Tensor, params: Iterable[torch.Tensor], anchor: Iterable[torch.Tensor] | None,
              mu: float) -> torch.Tensor:
    """What a step descends: the batch's mean loss, plus FedProx's ``mu/2 * ||w - anchor||^2`` with an anchor."""
    return loss if not anchor else loss + proximal_term(params, anchor, mu)


def update(params: list[nn.Parameter], descended: torch.Tensor, lr: float, optimizer: Any = None,
           anchor: list[torch.Tensor] | None = None, mu: float = 0.0) -> None:
    """One step down ``descended``: fresh gradients of ``params`` (plus FedProx's pull toward ``anchor`` when one is
    given: sharded parameters, whose objective cannot hold the proximal term), then :func:`apply_gradients`."""
    for p in params:
        p.grad = None
    descended.backward()
    if anchor is not None:
        add_proximal_gradient(params, anchor, mu)
    apply_gradients(params, lr, optimizer)


def apply_gradients(params: list[torch.Tensor], lr: float, optimizer: Any = None) -> None:
    """The update from the gradients the tensors hold: the task's ``optimizer`` steps, else plain SGD at ``lr``."""
    if optimizer is None:
        sgd_step(params, lr)
    else:
        optimizer.step()


@dataclass
class Lane:
    """One member's clock in the loop: the ``time.monotonic()`` its training must not pass, the simulated seconds
    each of its steps adds to its clock (billed, not slept: a stacked member's slow device) and the seconds that
    must stay free after its last step (an engine's gather)."""

    stop_at: float = math.inf
    step_delay: float = 0.0
    reserve: float = 0.0


class Stepper(Protocol):
    """How one step of the members still training is computed (one model, an engine's ranks, a stack)."""

    def active(self) -> list[int]:
        """The members that have a step left and have not left."""

    def step(self) -> None:
        """One step of every active member, counted in its tally."""

    def leave(self, members: list[int]) -> None:
        """Stop ``members`` before their next step: their weights stay as they are."""

    def tallies(self) -> list[StepTally]:
        """What each member trained on so far (steps, examples, loss sum)."""


class DeadlineRule:
    """"Would the next step pass stop_at?" for every lane: a lane's clock is the real time plus its simulated delay
    per step taken; a step costs ``clock``'s smoothed step time plus that delay. The clock is read only when some
    deadline could be near (at most half the steps that certainly fit are skipped), since on an accelerator a read
    (``wait``) waits for every queued step."""

    def __init__(self, lanes: list[Lane], clock: StepClock, wait: Callable[[], None] | None = None):
        self.lanes, self.clock, self.wait = lanes, clock, wait
        self._last: tuple[int, float] | None = None
        self._next_check = 0 if any(math.isfinite(lane.stop_at) for lane in lanes) else math.inf
        clock.restart()  # its estimate serves the first test; the first span measured replaces it

    def late(self, step: int, active: list[int]) -> list[int]:
        """The ``active`` lanes (each ``step`` steps in) whose deadline the next step would pass."""
        if step < self._next_check:
            return []
        if self.wait is not None:
            self.wait()
        now = time.monotonic()
        if self._last is not None and step > self._last[0]:
            self.clock.measured((now - self._last[1]) / (step - self._last[0]))
        self._last = (step, now)
        late, fits = [], math.inf
        for k in active:
            lane = self.lanes[k]
            per_step = self.clock.seconds + lane.step_delay
            slack = lane.stop_at - lane.reserve - (now + step * lane.step_delay)
            if slack < per_step:
                late.append(k)
            elif per_step > 0:
                fits = min(fits, slack / per_step - 1)  # steps that certainly fit at this pace
        if self.clock.seconds == 0.0:  # no pace known yet
            self._next_check = step + 1
        else:
            self._next_check = step + max(1, int(0.5 * fits)) if fits < math.inf else math.inf
        return late


def run_loop(stepper: Stepper, lanes: list[Lane], clock: StepClock | None = None,
             wait: Callable[[], None] | None = None, decide: Callable[[list[int]], list[int]] | None = None,
             after_step: Callable[[], None] | None = None) -> list[StepTally]:
    """Step ``stepper``'s members until none has a step left, each leaving before a step its deadline would not
    allow; every member's tally (``stopped``: its deadline cut it short). ``decide(late)``: the late members as the
    group agrees (an engine's rank 0 decides for every rank), asked before every step; ``after_step``: called after
    each step (a simulated slow device sleeps there); ``wait``: lets queued device work finish before a clock read."""
    rule = DeadlineRule(lanes, clock if clock is not None else StepClock(), wait)
    stopped, step = [False] * len(lanes), 0
    while True:
        active = stepper.active()
        if not active:
            break
        late = rule.late(step, active)
        if decide is not None:
            late = decide(late)
        if late:
            stepper.leave(late)
            for k in late:
                stopped[k] = True
            continue
        stepper.step()
        step += 1
        if after_step is not None:
            after_step()
    if wait is not None:
        wait()
    tallies = stepper.tallies()
    for tally, cut in zip(tallies, stopped):
        tally.stopped = cut
    return tallies


class OneMember:
    """The Stepper of one member whose batches come one at a time: ``step(batch)`` trains on one and returns the
    examples it held and their summed loss (a tensor may stay on the device)."""

    def __init__(self, batches: Iterable, step: Callable[[Any], tuple[int, float | torch.Tensor]]):
        self._batches, self._step = iter(batches), step
        self._next = next(self._batches, None)
        self._left = False
        self._tally = StepTally()

    def active(self) -> list[int]:
        """[0] while a batch is left and the member has not left."""
        return [0] if self._next is not None and not self._left else []

    def step(self) -> None:
        """Train on the next batch."""
        examples, loss_sum = self._step(self._next)
        self._tally.steps += 1
        self._tally.examples += examples
        self._tally.loss_sum += loss_sum
        self._next = next(self._batches, None)

    def leave(self, members: list[int]) -> None:
        """Stop before the next batch."""
        self._left = True

    def tallies(self) -> list[StepTally]:
        """The member's tally."""
        return [self._tally]
