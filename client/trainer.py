"""Local training and evaluation of a PyTorch classifier on data that never leaves the agent."""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Iterator

import torch
from torch import nn

from fedpar.aggregation.fedprox import proximal_term
from fedpar.client.local_sgd import StepClock, TrainResult, descend, run_steps, shuffling_generator, trainable
from fedpar.datasets import ArrayDataset
from fedpar.models.evaluation import EvalResult, evaluate_classifier
from fedpar.models.losses import classification_loss
from fedpar.parallel.config import PRECISIONS
from fedpar.parallel.device import synchronize



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
        self._clock = StepClock()

    def use_data(self, train: ArrayDataset, val: ArrayDataset | None, seed: int,
                 seconds_per_step_delay: float = 0.0) -> None:
        """Train from now on as another client: its data, its shuffling seed, its device speed (a simulation
        host's seat takes on each sampled virtual client in turn)."""
        self.x, self.y = (t.to(self.device) for t in train.to_tensors())
        self.val = tuple(t.to(self.device) for t in val.to_tensors()) if val is not None and len(val) else None
        self.seed = seed
        self.delay = seconds_per_step_delay
        self._clock = StepClock()

    def warm_up(self) -> None:
        """One forward, backward and (zero-step) SGD step on two examples, so torch's lazy set-up is not billed
        to a deadline."""
        self.model.train()
        params = trainable(self.model)
        with self._autocast():
            loss = classification_loss(self.model(self.x[:2]), self.y[:2])
        descend(params, loss, lr=0.0)  # the weights do not change
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
              proximal_mu: float = 0.0, round_id: int = 0, max_steps: int | None = None) -> TrainResult:
        """Train for ``epochs`` (at most ``max_steps`` steps) or until ``time.monotonic()`` would pass ``stop_at``,
        whichever is first."""
        start = time.monotonic()
        model = self.model
        model.train()
        params = trainable(model)
        anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else None

        def go_on() -> bool:
            synchronize(self.device)  # the clock must see the queued GPU work, or the deadline is missed
            return self._clock.fits(stop_at)

        def step(idx: torch.Tensor) -> tuple[int, torch.Tensor]:
            with self._autocast():
                loss = classification_loss(model(self.x[idx]), self.y[idx])
            objective = loss if anchor is None else loss + proximal_term(model.parameters(), anchor, proximal_mu)
            descend(params, objective, lr)
            if self.delay:
                self._pause(self.delay)
            loss_sum = loss.detach().double() * len(idx)
            synchronize(self.device)
            return len(idx), loss_sum

        with self._taking_turn():
            batches = itertools.islice(self._batches(epochs, batch_size, round_id), max_steps)
            tally = run_steps(batches, step, go_on, self._clock)
        return tally.result(time.monotonic() - start)

    def _batches(self, epochs: int, batch_size: int, round_id: int) -> Iterator[torch.Tensor]:
        """The example indices of each batch, epoch after epoch, in this client's order for ``round_id``."""
        gen = shuffling_generator(self.seed, round_id)
        n = len(self.y)
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen).to(self.device)  # drawn on the CPU: same order anywhere
            for begin in range(0, n, batch_size):
                yield order[begin:begin + batch_size]

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

