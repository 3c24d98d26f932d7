"""Local training and evaluation of a PyTorch classifier on data that never leaves the agent."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.sgd import sgd

from fedpar.datasets import ArrayDataset
from fedpar.models.evaluation import EvalResult, evaluate_classifier
from fedpar.models.losses import classification_loss
from fedpar.parallel.device import synchronize


@dataclass
class TrainResult:
    """What one local training run did: the honest basis of the update's FedAvg weight."""

    steps: int
    examples: int  # examples actually trained on (counted once per epoch they were seen in)
    loss: float
    stopped_early: bool
    seconds: float


PRECISIONS = ("fp32", "bf16")


class LocalTrainer:
    """Runs SGD epochs over local arrays on one device, stopping before a wall-clock limit.

    The model and the local data live on ``device`` for the trainer's life; ``precision="bf16"`` runs forward
    passes under bf16 autocast (weights, gradients and the update stay fp32, so uploads are unchanged).
    """

    def __init__(self, model: nn.Module, train: ArrayDataset, val: ArrayDataset | None = None,
                 seed: int = 0, seconds_per_step_delay: float = 0.0,
                 compute_lock: threading.Lock | None = None, device: torch.device | str = "cpu",
                 precision: str = "fp32"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.device = torch.device(device)
        self.precision = precision
        self.model = model.to(self.device)
        # Agents sharing one process share its interpreter lock: stepping dozens of small models at once only
        # adds lock hand-offs and cache misses (several times slower per step), so such hosts pass one lock and
        # each agent trains in one turn (a simulated slow device gives the turn up while it sleeps).
        self._turn = compute_lock
        self.x, self.y = (t.to(self.device) for t in train.to_tensors())
        self.val = tuple(t.to(self.device) for t in val.to_tensors()) if val is not None and len(val) else None
        self.seed = seed
        self.delay = seconds_per_step_delay  # simulated slow hardware (simulations only)
        self._step_seconds = 0.0

    def warm_up(self) -> None:
        """One forward, backward and (zero-step) SGD step on two examples, so torch's lazy set-up is not billed
        to a deadline."""
        self.model.train()
        params = trainable(self.model)
        with self._autocast():
            loss = classification_loss(self.model(self.x[:2]), self.y[:2])
        loss.backward()
        sgd_step(params, lr=0.0)  # the weights do not change
        for p in params:
            p.grad = None

    @property
    def num_examples(self) -> int:
        """Size of the local training set."""
        return len(self.y)

    def holding_task(self, round_id: int) -> contextlib.AbstractContextManager:
        """The span in which the agent holds a task of ``round_id`` (nothing to do here; a trainer that batches
        several agents' training uses it to know whom to wait for)."""
        return contextlib.nullcontext()

    def train(self, epochs: int, batch_size: int, lr: float, stop_at: float = math.inf,
              proximal_mu: float = 0.0, round_id: int = 0) -> TrainResult:
        """Train for ``epochs`` or until ``time.monotonic()`` would pass ``stop_at``, whichever is first."""
        start = time.monotonic()
        model = self.model
        model.train()
        params = trainable(model)
        anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else None
        gen = shuffling_generator(self.seed, round_id)
        steps = examples = 0
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        stopped = False
        n = len(self.y)
        with self._taking_turn():
            for _ in range(epochs):
                order = torch.randperm(n, generator=gen).to(self.device)  # drawn on the CPU: same order anywhere
                for begin in range(0, n, batch_size):
                    synchronize(self.device)  # the clock must see the queued GPU work, or the deadline is missed
                    if time.monotonic() + self._step_seconds > stop_at:
                        stopped = True
                        break
                    t0 = time.monotonic()
                    idx = order[begin:begin + batch_size]
                    with self._autocast():
                        loss = classification_loss(model(self.x[idx]), self.y[idx])
                    objective = loss
                    if anchor is not None:
                        # FedProx (Li et al. 2020): keep local weights near the global ones.
                        objective = loss + 0.5 * proximal_mu * sum(
                            (p - a).pow(2).sum() for p, a in zip(model.parameters(), anchor))
                    for p in params:
                        p.grad = None
                    objective.backward()
                    sgd_step(params, lr)
                    if self.delay:
                        self._pause(self.delay)
                    steps += 1
                    examples += len(idx)
                    loss_sum += loss.detach().double() * len(idx)
                    synchronize(self.device)
                    dt = time.monotonic() - t0
                    self._step_seconds = dt if steps == 1 else 0.8 * self._step_seconds + 0.2 * dt
                if stopped:
                    break
        return TrainResult(steps, examples, loss_sum.item() / examples if examples else float("nan"), stopped,
                           time.monotonic() - start)

    @torch.no_grad()
    def evaluate(self, batch_size: int = 1024) -> EvalResult | None:
        """Loss and accuracy on the local validation split (None when there is none)."""
        if self.val is None:
            return None
        with self._taking_turn():
            return evaluate_classifier(self.model, *self.val, batch_size=batch_size)

    def _autocast(self):
        """bf16 autocast around a forward pass when asked for, else nothing."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    @contextlib.contextmanager
    def _taking_turn(self):
        """Hold this process's compute turn (if agents share one) for the duration."""
        if self._turn is None:
            yield
            return
        with self._turn:
            yield

    def _pause(self, seconds: float) -> None:
        """Sleep like a slow device would, without holding the compute turn."""
        if self._turn is None:
            time.sleep(seconds)
            return
        self._turn.release()
        try:
            time.sleep(seconds)
        finally:
            self._turn.acquire()


def shuffling_generator(seed: int, round_id: int) -> torch.Generator:
    """The generator of a client's batch order in round ``round_id``: one ``torch.randperm`` per epoch."""
    return torch.Generator().manual_seed(seed * 1_000_003 + round_id)


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
