"""The members a worker trains at once, as one stacked model: the one local loop (client/local_loop.py) run with
each step computed for all of them: the model's forward ``vmap``-ped over a leading member axis, one backward of the
sum of their objectives.

Training a round's small members one after another leaves an accelerator idle between kernel launches. Here the
K members' copies of one model are stacked along a leading axis. Each member keeps what the loop gives it alone: its
own batch schedule (the same generator, seed and ``randperm`` sequence), its own example count (the smaller last
batch of an epoch is padded and masked, and the loss is the mean over its real examples, so the gradient is the
unpadded one), its own number of steps, the FedProx term, its own deadline and the task's optimizer (an elementwise
one: each member's state is its own rows). A member that has no step left leaves the stack, and its parameters stop
changing. The task's loss is taken to be the mean of per-example losses (as on the engine), computed per example.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call, vmap

from fedpar.client.local_loop import (Lane, StepTally, TrainResult, apply_gradients, objective, run_loop,
                                      stacked_schedules)
from fedpar.client.step_graph import EAGER_STEPS, GraphedSteps, recordable
from fedpar.models.losses import classification_loss
from fedpar.parallel.device import synchronize
from fedpar.task import StepClock, Task
from fedpar.tasks.data import in_memory

# Optimizers whose update of each element reads only that element and its own state: stepping the stacked
# parameters steps every member as its own optimizer would.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
                          torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)
OptimizerFactory = Callable[[list, float], Any]
# A parameter of at least this many bytes a member is stacked in its gradient's layout (ClientBatch._lay_out_as).
# Thread CPU time of stacked training, one torch thread, 2026-11-25 (benchmarks/stacked_cpu_bench.py): the layout
# took the MNIST CNN's round (6.4 MB a member's matrix) from 1.62x one by one to 1.10, the digits CNN's (512 KiB)
# from 1.63 to 1.01-1.07 and the MNIST MLP's (392 KiB) from 1.15 to 0.78-0.95; the digits MLP's (32 KiB) was 0.37-0.42
# without it and 0.43-0.48 with it.
LAYOUT_BYTES = 256 << 10
# A working stack's step is recorded as a CUDA graph only when at least this many steps remain before its next
# change (a member leaving): the recording costs about as much as a few eager steps.
GRAPH_MIN_STEPS = 8


@dataclass
class ClientBatchInput:
    """One member of a batched run: its local data, its shuffling seed, its start weights and its clock."""

    x: torch.Tensor
    y: torch.Tensor
    seed: int  # the member's shuffling seed: its batch order
    start: dict[str, torch.Tensor] | None = None  # start weights (and FedProx anchor); None: the model's own
    stop_at: float = math.inf  # the time.monotonic() the member's training must not pass
    step_delay: float = 0.0  # a simulated slow device's extra seconds per step: added to its clock, not slept
    max_steps: int | None = None  # at most this many steps (a virtual clock's cap)


@dataclass
class StackedWeights:
    """Every member's trained parameters of one stack, as it ended: ``params[name]`` is (members, *shape) on the CPU
    (row k: member k; named as in model.named_parameters()) and ``examples`` (members,) int64 the examples each
    trained on (a linear strategy's weights): a host's members' updates as tensors, for sums over the rows."""

    params: dict[str, torch.Tensor]
    examples: torch.Tensor


@dataclass
class ClientBatchOutput:
    """One member's trained parameters (CPU tensors, named as in model.named_parameters(): views of row ``row`` of
    ``stack``) and its TrainResult."""

    weights: dict[str, torch.Tensor]
    result: TrainResult
    stack: StackedWeights | None = None
    row: int = 0


def check_batchable(model: nn.Module) -> None:
    """Raise ValueError if a training step of ``model`` is not a pure function of its weights and the batch."""
    for name, module in model.named_modules():
        stateful = isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
        random = isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
        if stateful or random:
            raise ValueError(f"client batching needs a model without batch-norm statistics or dropout (each "
                             f"member's step must be a function of its weights and batch alone); "
                             f"{name or 'the model'} is {_a(type(module).__name__)}")


def _a(word: str) -> str:
    """``word`` after its indefinite article, by its first letter: 'an Adafactor', 'a SGD'."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def batching_refusal(task: Task) -> str | None:
    """Why ``task``'s members cannot train stacked (one line), or None when they can: its model's layers, its own
    train hook, its loader or a non-elementwise optimizer."""
    if task.train is not None:
        return (f"task {task.name!r} trains with its own train hook, which runs one member at a time; drop "
                "--client-batching")
    if task.loader is not None:
        return (f"task {task.name!r} batches its data with its own loader; client batching cuts in-memory "
                "(inputs, targets) data itself: drop the loader or --client-batching")
    if task.optimizer is not None:
        optimizer = task.optimizer([torch.zeros(1, requires_grad=True)], 0.1)
        if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            return (f"the optimizer of task {task.name!r} is {_a(type(optimizer).__name__)}; client batching steps the "
                    f"stacked members with elementwise optimizers only "
                    f"({', '.join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)}): drop --client-batching")
    try:
        check_batchable(task.model())
    except ValueError as exc:
        return f"task {task.name!r}: {exc}"
    return None


def member_tensors(dataset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) tensors of a member's in-memory training data; ValueError for other data."""
    tensors = in_memory(dataset)
    if tensors is None or len(tensors) != 2:
        raise ValueError("client batching needs each member's training data in memory as (inputs, targets) "
                         f"tensors (an ArrayDataset or a TensorDataset of two), got a {type(dataset).__name__}")
    return tensors[0], tensors[1]


def per_example_losses(loss: Callable, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``loss`` (a batch mean) of each example alone, for (members, batch, ...) outputs and targets: the loss of
    one-example batches, computed for all at once (the zoo's cross-entropy unreduced: a vmap of one-example batches
    runs its decomposition, several times slower to differentiate on the CPU)."""
    if loss is classification_loss:
        return classification_loss(outputs.flatten(0, 1), targets.flatten(0, 1), reduction="none") \
            .view(targets.shape[:2])
    one = vmap(lambda o, t: loss(o.unsqueeze(0), t.unsqueeze(0)))
    return vmap(one)(outputs, targets)


# Batched objectives live as long as their model: a batcher that reuses one template model builds its function once,
# not every round.
_objectives: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
# ... and the layouts of its gradients (ClientBatch._lay_out_as), so a later stack starts laid out so
_gradient_orders: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def batched_objective_fn(model: nn.Module, buffers: dict[str, torch.Tensor], proximal_mu: float = 0.0,
                         loss: Callable = classification_loss) -> Callable:
    """``f(params, anchor, x, y, mask, count) -> (total, losses)`` over a leading member axis: the sum of the
    members' objectives (client/local_loop.py) on their batches, each loss the masked mean of ``loss`` per example
    (FedProx's term when ``anchor`` is not empty), and those losses. The members are independent, so the gradient
    of the sum by a member's row of ``params`` is that member's own gradient (one backward for the stack, by
    autograd: cheaper per step than a vmap of per-member gradients)."""
    key = (proximal_mu, loss, tuple((n, b.device) for n, b in buffers.items()))
    if key in _objectives.get(model, {}):
        return _objectives[model][key]
    forward = vmap(lambda params, x: functional_call(model, (params, buffers) if buffers else params, (x,)))

    def stacked_objective(params, anchor, x, y, mask, count):
        means = (per_example_losses(loss, forward(params, x), y) * mask).sum(dim=1) / count  # padding adds 0s
        return objective(means.sum(), [params[n] for n in anchor], anchor.values(), proximal_mu), means

    _objectives.setdefault(model, {})[key] = stacked_objective
    return stacked_objective


class ClientBatch:
    """The Stepper (client/local_loop.py) of K members' copies of one model stacked on ``device``, stepped
    together, each on its own batches.

    Only the members still training (``active()``) are computed: when one finishes or leaves, the working stack
    (and the optimizer's state) is written back and rebuilt without it (rare: at most K times), so the others'
    steps stay dense. Every active member has taken exactly ``step_index`` steps.
    """

    def __init__(self, model: nn.Module, clients: list[ClientBatchInput], epochs: int, batch_size: int, lr: float,
                 round_id: int = 0, device: str | torch.device = "cpu", proximal_mu: float = 0.0,
                 loss: Callable = classification_loss, optimizer: OptimizerFactory | None = None,
                 cuda_graphs: bool = True):
        check_batchable(model)
        if not clients:
            raise ValueError("a client batch needs at least one client")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.device = torch.device(device)
        self.model, self.mu, self.clients, self.lr = model, proximal_mu, clients, lr
        self._make_optimizer, self._optimizer = optimizer, None
        own = {name: p.detach() for name, p in model.named_parameters()}
        self.names = list(own)
        self._trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        self._buffers = {name: b.to(self.device) for name, b in model.named_buffers()}
        starts = [c.start if c.start is not None else own for c in clients]
        self.params = {name: torch.stack([s[name].detach() for s in starts]).to(self.device) for name in self.names}
        self._anchor = {name: p.clone() for name, p in self.params.items()} if proximal_mu > 0 else {}
        self.x = torch.cat([c.x for c in clients]).to(self.device)
        self.y = torch.cat([c.y for c in clients]).to(self.device)
        self._index, self._mask, self.total_steps = self._schedules(epochs, batch_size, round_id)
        self._counts = self._mask.sum(dim=2)  # real examples per member and step
        self._mask = self._mask.to(self.params[self.names[0]].dtype)
        self._loss_sums = torch.zeros(len(clients), dtype=torch.float64, device=self.device)
        self.steps_done = [0] * len(clients)
        self.stopped = [False] * len(clients)
        self.step_index = 0
        self._active = [k for k in range(len(clients)) if self.total_steps[k] > 0]
        self._objective_fn = batched_objective_fn(model, self._buffers, proximal_mu, loss)
        # On CUDA, plain SGD's steps replay as one CUDA graph (client/step_graph.py); a step counter on the device
        # picks each step's batch column, so a replay needs nothing from the host.
        self._graphs = cuda_graphs and self.device.type == "cuda" and optimizer is None
        self._graphed: GraphedSteps | None = None
        self._step_on_device: torch.Tensor | None = None
        self.graph_steps = 0  # steps run by a CUDA graph (its recording's included)
        # each parameter's gradient's dimensions, outermost first (known once a stack of this model has stepped)
        self._orders: dict[str, tuple[int, ...]] = _gradient_orders.get(model, {})
        self._load_working(list(range(len(self._active))))

    def _schedules(self, epochs: int, batch_size: int, round_id: int):
        """Every member's batches as global example indices, padded to the longest schedule, on the device."""
        sizes = [len(c.y) for c in self.clients]
        index, mask = stacked_schedules(sizes, [c.seed for c in self.clients], epochs, batch_size, round_id)
        total = [min(-(-n // batch_size) * epochs, c.max_steps) if c.max_steps is not None
                 else -(-n // batch_size) * epochs for n, c in zip(sizes, self.clients)]
        longest = max(total, default=0)
        return index[:, :longest].to(self.device), mask[:, :longest].to(self.device), total

    def _load_working(self, kept: list[int]) -> None:
        """Gather the active members' parameters, schedules and loss sums into the working stack; ``kept``: the
        rows of the previous stack they were (their optimizer state moves with them)."""
        rows = torch.tensor(self._active, dtype=torch.long, device=self.device)
        self._rows = rows
        self._graphed = None  # its tensors are about to be replaced
        trainable = set(self._trainable)
        self._work = {name: _laid_out(p.index_select(0, rows), self._orders.get(name))
                      .requires_grad_(name in trainable) for name, p in self.params.items()}
        self._work_anchor = {name: a.index_select(0, rows) for name, a in self._anchor.items()}
        self._work_index, self._work_mask = self._index.index_select(0, rows), self._mask.index_select(0, rows)
        self._work_counts = self._counts.index_select(0, rows)
        self._work_loss = self._loss_sums.index_select(0, rows)
        if self._make_optimizer is not None:
            self._optimizer = self._moved_optimizer(self._optimizer, kept)

    def _moved_optimizer(self, old: Any, kept: list[int]) -> Any:
        """A task optimizer over the working stack, holding ``old``'s state of the ``kept`` rows."""
        params = [self._work[name] for name in self._trainable]
        optimizer = self._make_optimizer(params, self.lr)
        if old is None:
            return optimizer
        rows = torch.tensor(kept, dtype=torch.long, device=self.device)
        for before, after in zip([p for group in old.param_groups for p in group["params"]], params):
            state = old.state.get(before)
            if state:
                optimizer.state[after] = {key: value.index_select(0, rows)
                                          if isinstance(value, torch.Tensor) and value.ndim and
                                          value.shape[:1] == before.shape[:1] else value
                                          for key, value in state.items()}
        return optimizer

    def _store_working(self) -> None:
        """Write the working stack back into the per-member tensors."""
        with torch.no_grad():
            for name, p in self.params.items():
                p.index_copy_(0, self._rows, self._work[name])
        self._loss_sums.index_copy_(0, self._rows, self._work_loss)
        for k in self._active:
            self.steps_done[k] = self.step_index

    def client_weights(self, k: int) -> dict[str, torch.Tensor]:
        """Member ``k``'s parameters now (on the device; a copy)."""
        if k in self._active:
            row = self._active.index(k)
            return {name: p[row].detach().clone() for name, p in self._work.items()}
        return {name: p[k].clone() for name, p in self.params.items()}

    def gradients(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The active members' gradients of their objectives on this step's batches, and their losses."""
        s = self.step_index
        return self._gradients_on(self._work_index[:, s], self._work_mask[:, s], self._work_counts[:, s])

    def _gradients_on(self, index: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) \
            -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The gradients and losses of the batches ``index`` (a row of global example indices per active member)."""
        total, losses = self._objective_fn(self._work, self._work_anchor, self.x[index], self.y[index], mask, count)
        grads = dict(zip(self._trainable, torch.autograd.grad(total, [self._work[name] for name in self._trainable])))
        if self.model not in _gradient_orders:
            self._lay_out_as(grads)
        return grads, losses.detach()

    def _lay_out_as(self, grads: dict[str, torch.Tensor]) -> None:
        """Lay the working stack's large parameters out as their gradients are (before the first update, once): a
        vmapped linear layer's weight gradient comes transposed, and an update reading it across a contiguous stack
        ran 14x slower on the CPU (31 ms a step for the MNIST CNN's 5 x 1.6M-weight layer, against 2.2). A member's
        small matrix is read across in cache, and there the other layout only cost the steps more (see
        :data:`LAYOUT_BYTES`)."""
        members = len(self._active)
        self._orders = _gradient_orders[self.model] = {
            name: _dimension_order(g) for name, g in grads.items()
            if g.numel() // max(1, members) * g.element_size() >= LAYOUT_BYTES}
        if any(_dimension_order(self._work[name]) != order for name, order in self._orders.items()):
            self._store_working()
            self._optimizer = None  # no step taken yet: nothing of its state to keep
            self._load_working(list(range(members)))

    def active(self) -> list[int]:
        """The members still training."""
        return list(self._active)

    def step(self) -> None:
        """One step of every active member: the task's optimizer (elementwise) or plain SGD on the stack."""
        if self._graphed is None and self._worth_recording():
            self._step_on_device = torch.full((1,), self.step_index, dtype=torch.long, device=self.device)
            self._graphed = GraphedSteps(self._counted_step, self.model, self.device)
        if self._graphed is not None:
            self._graphed.run()
            self.graph_steps += self._graphed.recorded
        else:
            s = self.step_index
            self._step_on(self._work_index[:, s], self._work_mask[:, s], self._work_counts[:, s])
        self.step_index += 1
        done = [k for k in self._active if self.total_steps[k] == self.step_index]
        if done:
            self._drop(done)

    def _step_on(self, index: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> None:
        """Step the working stack on the batches ``index`` (``mask``: real examples, ``count``: their number)."""
        grads, losses = self._gradients_on(index, mask, count)
        params = [self._work[name] for name in self._trainable]  # after the gradients: a first step lays them out
        for name, p in zip(self._trainable, params):
            p.grad = grads[name]
        apply_gradients(params, self.lr, self._optimizer)
        for p in params:
            p.grad = None
        self._work_loss += losses.double() * count

    def _counted_step(self) -> None:
        """The step whose batch column the device's step counter names, which it then advances (the recorded step)."""
        column = self._step_on_device
        self._step_on(*(t.index_select(1, column).squeeze(1)
                        for t in (self._work_index, self._work_mask, self._work_counts)))
        column += 1

    def _worth_recording(self) -> bool:
        """Whether this working stack's step should become a CUDA graph: plain SGD on CUDA, the layout settled, a
        recordable model, and enough steps before the stack next changes to repay the recording."""
        if not (self._graphs and self._active and self.model in _gradient_orders and recordable(self.model)):
            return False
        return min(self.total_steps[k] for k in self._active) - self.step_index >= EAGER_STEPS + GRAPH_MIN_STEPS

    def leave(self, members: list[int]) -> None:
        """Stop ``members`` before their next step (their deadline): their parameters freeze."""
        for k in members:
            self.stopped[k] = True
        self._drop(members)

    def _drop(self, members: list[int]) -> None:
        """Take ``members`` out of the working stack."""
        self._store_working()
        kept = [row for row, k in enumerate(self._active) if k not in members]
        self._active = [k for k in self._active if k not in members]
        if self._active:
            self._load_working(kept)

    def tallies(self) -> list[StepTally]:
        """Each member's steps, examples (its real ones) and loss sum so far."""
        if self._active:
            self._store_working()
        counts = self._counts.cpu()
        loss_sums = self._loss_sums.cpu().tolist()
        return [StepTally(steps, int(counts[k, :steps].sum()), loss_sums[k], self.stopped[k])
                for k, steps in enumerate(self.steps_done)]

    def outputs(self, seconds: float) -> list[ClientBatchOutput]:
        """Every member's trained parameters on the CPU and its TrainResult (``seconds``: the batch's wall time,
        plus each member's simulated step delays)."""
        tallies = self.tallies()
        stack = StackedWeights({name: p.detach().cpu() for name, p in self.params.items()},
                               torch.tensor([tally.examples for tally in tallies], dtype=torch.long))
        return [ClientBatchOutput({name: p[k] for name, p in stack.params.items()},
                                  tally.result(seconds + tally.steps * c.step_delay), stack, k)
                for k, (c, tally) in enumerate(zip(self.clients, tallies))]


def _dimension_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dimensions from the outermost in memory to the innermost."""
    return tuple(sorted(range(t.ndim), key=lambda d: (-t.stride(d), d)))


def _laid_out(t: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """``t`` (contiguous) with its dimensions laid out in memory in ``order`` (None: as it is)."""
    if order is None or order == tuple(range(t.ndim)):
        return t
    return t.permute(order).contiguous().permute([order.index(d) for d in range(t.ndim)])


def train_clients_batched(model: nn.Module, clients: list[ClientBatchInput], epochs: int, batch_size: int,
                          lr: float, round_id: int = 0, device: str | torch.device = "cpu",
                          proximal_mu: float = 0.0, loss: Callable = classification_loss,
                          optimizer: OptimizerFactory | None = None,
                          cuda_graphs: bool = True) -> list[ClientBatchOutput]:
    """Train each member from its start weights as the local loop would alone, all of them stacked: ``loss`` (a
    batch mean) and ``optimizer(params, lr)`` are the task's (default: cross-entropy and plain SGD).

    ``model`` only lends its architecture (and its parameters as the default start); it is not changed.
    ``cuda_graphs`` (on CUDA with plain SGD): each working stack's whole step is recorded once as a CUDA graph and
    replayed (client/step_graph.py); False keeps every step eager.
    """
    if not clients:
        return []
    start = time.monotonic()
    batch = ClientBatch(model, clients, epochs, batch_size, lr, round_id, device, proximal_mu, loss, optimizer,
                        cuda_graphs)
    run_loop(batch, [Lane(c.stop_at, c.step_delay) for c in clients], StepClock(),
             wait=lambda: synchronize(batch.device))
    return batch.outputs(time.monotonic() - start)
