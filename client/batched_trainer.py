"""Many clients' local training as one batched model: stacked parameters, torch.func over the client axis.

Training a round's small clients one after another leaves an accelerator idle between kernel launches. Here
the K clients' copies of one model are stacked along a leading axis, and each SGD step is one call of
``vmap(grad(functional_call))`` over that axis. Each client still computes what :class:`LocalTrainer` computes
alone: its own batch order (the same generator, seed and ``randperm`` sequence), its own example count (the
smaller last batch of an epoch is padded and masked, and the loss is the mean over its real examples, so the
gradient is the unpadded one), its own number of steps, the FedProx term and its own deadline. A client that
has no step left leaves the batch, and its parameters stop changing.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedpar.aggregation.fedprox import proximal_term
from fedpar.client.local_sgd import StepTally, TrainResult, sgd_step, shuffling_generator
from fedpar.models.losses import classification_loss
from fedpar.parallel.device import synchronize
from fedpar.task import StepClock


@dataclass
class ClientBatchInput:
    """One client of a batched run: its local data, its LocalTrainer seed, its start weights and its clock."""

    x: torch.Tensor
    y: torch.Tensor
    seed: int  # the client's LocalTrainer seed: its batch order
    start: dict[str, torch.Tensor] | None = None  # start weights (and FedProx anchor); None: the model's own
    stop_at: float = math.inf  # the time.monotonic() the client's training must not pass (LocalTrainer's stop_at)
    step_delay: float = 0.0  # a simulated slow device's extra seconds per step: added to its clock, not slept
    max_steps: int | None = None  # at most this many steps (a virtual clock's cap, as LocalTrainer's max_steps)


@dataclass
class ClientBatchOutput:
    """One client's trained parameters (CPU tensors, named as in model.named_parameters()) and its TrainResult."""

    weights: dict[str, torch.Tensor]
    result: TrainResult


def check_batchable(model: nn.Module) -> None:
    """Raise ValueError if a training step of ``model`` is not a pure function of its weights and the batch."""
    for name, module in model.named_modules():
        stateful = isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
        random = isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
        if stateful or random:
            raise ValueError(f"client batching needs a model without batch-norm statistics or dropout; "
                             f"{name or 'the model'} is a {type(module).__name__}")


def batch_schedule(n: int, seed: int, epochs: int, batch_size: int, round_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LocalTrainer's batches of one client with ``n`` examples: (steps, batch_size) example indices and a bool
    mask of the real ones (the last batch of each epoch is padded with index 0)."""
    per_epoch = -(-n // batch_size)
    width = per_epoch * batch_size
    gen = shuffling_generator(seed, round_id)
    index = torch.zeros(epochs, width, dtype=torch.long)
    for epoch in range(epochs):
        index[epoch, :n] = torch.randperm(n, generator=gen)
    mask = (torch.arange(width) < n).expand(epochs, width)
    return index.reshape(epochs * per_epoch, batch_size), mask.reshape(epochs * per_epoch, batch_size)


# Compiled steps live as long as their model, so a batcher that reuses one template model compiles once.
_compiled: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def batched_gradient_fn(model: nn.Module, buffers: dict[str, torch.Tensor], proximal_mu: float = 0.0,
                        compile_step: bool = False) -> Callable:
    """``f(params, anchor, x, y, mask, count) -> (grads, losses)`` over a leading client axis: each client's
    gradient of its masked-mean cross-entropy (plus the FedProx term when ``anchor`` is not empty) on its batch."""
    key = (proximal_mu, tuple((n, b.device) for n, b in buffers.items()))
    if compile_step and key in _compiled.get(model, {}):
        return _compiled[model][key]

    def client_loss(params, anchor, x, y, mask, count):
        tensors = (params, buffers) if buffers else params
        per_example = classification_loss(functional_call(model, tensors, (x,)), y, reduction="none")
        loss = (per_example * mask).sum() / count  # mean over the real examples: padding adds exact zeros
        if not anchor:
            return loss, loss
        return loss + proximal_term([params[n] for n in anchor], anchor.values(), proximal_mu), loss

    step = vmap(grad(client_loss, has_aux=True))
    if compile_step:
        # Static shapes (one graph per number of active clients) replayed as CUDA graphs: the step is launch-bound.
        step = _compiled.setdefault(model, {})[key] = torch.compile(step, dynamic=False, mode="reduce-overhead")
    return step


class ClientBatch:
    """K clients' copies of one model stacked on ``device``, stepped together, each on its own batches.

    Only the clients still training (``active``) are computed: when one finishes or is stopped, the working
    stack is written back and rebuilt without it (rare: at most K times), so the others' steps stay dense.
    Every active client has taken exactly ``step_index`` steps.
    """

    def __init__(self, model: nn.Module, clients: list[ClientBatchInput], epochs: int, batch_size: int,
                 round_id: int = 0, device: str | torch.device = "cpu", proximal_mu: float = 0.0,
                 compile_step: bool = False):
        check_batchable(model)
        if not clients:
            raise ValueError("a client batch needs at least one client")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.device = torch.device(device)
        if compile_step and self.device.type != "cuda":
            # Measured with torch 2.13 on the CPU: inductor's CNN step drifted from the eager one after ~20 steps.
            raise ValueError("compile_step is for CUDA devices; on the CPU the compiled step did not reproduce "
                             "the eager gradients")
        self.model, self.mu, self.clients = model, proximal_mu, clients
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
        self._counts = self._mask.sum(dim=2)  # real examples per client and step
        self._mask = self._mask.to(self.params[self.names[0]].dtype)
        self._loss_sums = torch.zeros(len(clients), dtype=torch.float64, device=self.device)
        self.steps_done = [0] * len(clients)
        self.stopped = [False] * len(clients)
        self.step_index = 0
        self.active = [k for k in range(len(clients)) if self.total_steps[k] > 0]
        self._grad_fn = batched_gradient_fn(model, self._buffers, proximal_mu, compile_step)
        self._load_working()

    def _schedules(self, epochs: int, batch_size: int, round_id: int):
        """Every client's batches as global example indices, padded to the longest schedule, on the device."""
        plans, offset = [], 0
        for c in self.clients:
            index, mask = batch_schedule(len(c.y), c.seed, epochs, batch_size, round_id)
            plans.append((index + offset, mask))
            offset += len(c.y)
        total = [min(len(index), c.max_steps) if c.max_steps is not None else len(index)
                 for c, (index, _) in zip(self.clients, plans)]
        longest = max(total, default=0)
        index = torch.zeros(len(plans), longest, batch_size, dtype=torch.long)
        mask = torch.zeros(len(plans), longest, batch_size, dtype=torch.bool)
        for k, (i, m) in enumerate(plans):
            index[k, :len(i)], mask[k, :len(m)] = i, m
        return index.to(self.device), mask.to(self.device), total

    def _load_working(self) -> None:
        """Gather the active clients' parameters, schedules and loss sums into the working stack."""
        rows = torch.tensor(self.active, dtype=torch.long, device=self.device)
        self._rows = rows
        self._work = {name: p.index_select(0, rows) for name, p in self.params.items()}
        self._work_anchor = {name: a.index_select(0, rows) for name, a in self._anchor.items()}
        self._work_index, self._work_mask = self._index.index_select(0, rows), self._mask.index_select(0, rows)
        self._work_counts = self._counts.index_select(0, rows)
        self._work_loss = self._loss_sums.index_select(0, rows)

    def _store_working(self) -> None:
        """Write the working stack back into the per-client tensors."""
        for name, p in self.params.items():
            p.index_copy_(0, self._rows, self._work[name])
        self._loss_sums.index_copy_(0, self._rows, self._work_loss)
        for k in self.active:
            self.steps_done[k] = self.step_index

    def client_weights(self, k: int) -> dict[str, torch.Tensor]:
        """Client ``k``'s parameters now (on the device; a copy)."""
        if k in self.active:
            row = self.active.index(k)
            return {name: p[row].clone() for name, p in self._work.items()}
        return {name: p[k].clone() for name, p in self.params.items()}

    def gradients(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The active clients' gradients of their objectives on this step's batches, and their losses."""
        s = self.step_index
        index = self._work_index[:, s]
        return self._grad_fn(self._work, self._work_anchor, self.x[index], self.y[index], self._work_mask[:, s],
                             self._work_counts[:, s])

    def step(self, lr: float) -> None:
        """One SGD step of every active client (torch's own SGD update, as LocalTrainer's sgd_step)."""
        grads, losses = self.gradients()
        params = [self._work[name] for name in self._trainable]
        for name, p in zip(self._trainable, params):
            p.grad = grads[name]
        sgd_step(params, lr)
        for p in params:
            p.grad = None
        self._work_loss += losses.detach().double() * self._work_counts[:, self.step_index]
        self.step_index += 1
        done = [k for k in self.active if self.total_steps[k] == self.step_index]
        if done:
            self.leave(done)

    def leave(self, clients: list[int], stopped: bool = False) -> None:
        """Take ``clients`` out of the batch (``stopped``: before their last step); their parameters freeze."""
        self._store_working()
        for k in clients:
            self.stopped[k] = stopped
        self.active = [k for k in self.active if k not in clients]
        if self.active:
            self._load_working()

    def outputs(self, seconds: float) -> list[ClientBatchOutput]:
        """Every client's trained parameters on the CPU and its TrainResult (``seconds``: the batch's wall time,
        plus each client's simulated step delays)."""
        if self.active:
            self._store_working()
        params = {name: p.detach().cpu() for name, p in self.params.items()}
        counts = self._counts.cpu()
        loss_sums = self._loss_sums.cpu().tolist()
        out = []
        for k, c in enumerate(self.clients):
            steps = self.steps_done[k]
            result = StepTally(steps, int(counts[k, :steps].sum()), loss_sums[k], self.stopped[k]).result(
                seconds + steps * c.step_delay)
            out.append(ClientBatchOutput({name: p[k] for name, p in params.items()}, result))
        return out


class _Deadlines:
    """LocalTrainer's test "would the next step pass stop_at?" for every client of a batch.

    A client's clock is the real time plus its simulated delay per step taken; a step costs the smoothed
    batched step time plus that delay. The clock is read only when some deadline could be near (at most half
    the steps that certainly fit are skipped), since on CUDA a read waits for every queued step.
    """

    def __init__(self, clients: list[ClientBatchInput], device: torch.device):
        self.clients, self.device = clients, device
        self.pace = StepClock()  # of one batched step
        self._last: tuple[int, float] | None = None
        self._next_check = 0 if any(math.isfinite(c.stop_at) for c in clients) else math.inf

    def late(self, batch: ClientBatch) -> list[int]:
        """Active clients of ``batch`` whose deadline the next step would pass."""
        s = batch.step_index
        if s < self._next_check:
            return []
        synchronize(self.device)
        now = time.monotonic()
        if self._last is not None and s > self._last[0]:
            self.pace.measured((now - self._last[1]) / (s - self._last[0]))
        self._last = (s, now)
        late, fits = [], math.inf
        for k in batch.active:
            c = self.clients[k]
            per_step = self.pace.seconds + c.step_delay
            slack = c.stop_at - (now + s * c.step_delay)
            if slack < per_step:
                late.append(k)
            elif per_step > 0:
                fits = min(fits, slack / per_step - 1)  # steps that certainly fit at this pace
        if self.pace.seconds == 0.0:  # no pace measured yet
            self._next_check = s + 1
        else:
            self._next_check = s + max(1, int(0.5 * fits)) if fits < math.inf else math.inf
        return late


def train_clients_batched(model: nn.Module, clients: list[ClientBatchInput], epochs: int, batch_size: int,
                          lr: float, round_id: int = 0, device: str | torch.device = "cpu",
                          proximal_mu: float = 0.0, compile_step: bool = False) -> list[ClientBatchOutput]:
    """Train each client from its start weights as ``LocalTrainer.train`` would alone, all clients in one batch.

    ``model`` only lends its architecture (and its parameters as the default start); it is not changed.
    ``compile_step`` (CUDA only, experimental): ``torch.compile`` the batched gradient step into CUDA graphs, one
    per number of active clients; check its results against the eager step on the device before relying on it.
    """
    if not clients:
        return []
    start = time.monotonic()
    batch = ClientBatch(model, clients, epochs, batch_size, round_id, device, proximal_mu, compile_step)
    deadlines = _Deadlines(clients, batch.device)
    while batch.active:
        late = deadlines.late(batch)
        if late:
            batch.leave(late, stopped=True)
            continue
        batch.step(lr)
    synchronize(batch.device)
    return batch.outputs(time.monotonic() - start)
