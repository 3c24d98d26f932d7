"""The training loop over a parallelized model: accumulation, clipping, warmup, evaluation, checkpoints, outputs."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fedpar.datasets.arrays import CLASSIFICATION, TrainData, scale_hint
from fedpar.models.for_data import model_kwargs_for
from fedpar.models.losses import classification_loss, language_model_loss
from fedpar.parallel.checkpoint import (gather_full_state_dict, gather_pipeline_state_dict, latest_checkpoint,
                                       load_checkpoint, run_record, save_checkpoint)
from fedpar.parallel.config import ParallelLayout, TrainConfig
from fedpar.parallel.ddp import is_ddp
from fedpar.parallel.device import synchronize
from fedpar.parallel.fsdp import is_fsdp
from fedpar.parallel.init import DistInfo
from fedpar.parallel.mesh import build_mesh
from fedpar.parallel.metrics import (
    StepMetricsLog,
    gather_ints,
    model_state_bytes,
    peak_memory_bytes,
    plot_loss_curve,
    reset_peak_memory,
    write_json_atomic,
)
from fedpar.parallel.optim import (
    build_optimizers,
    clip_gradients,
    replicate_partial_grads,
    set_learning_rate,
    warmup_factor,
)
from fedpar.parallel.parallelize import parallelize
from fedpar.parallel.precision import uses_autocast
from fedpar.parallel.sampler import DistributedBatchSampler
from fedpar.parallel.stopping import held_stops
from fedpar.task import TaskFailed

# what a checkpoint keeps of the run's position; the last two are the log interval it was taken in (the steps since the
# last logged loss and their loss, summed as the mean over the ranks), so a resume's first row averages them all
COUNTERS = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "samples": 0, "interval_steps": 0, "interval_loss": 0.0}


class TrainingDiverged(TaskFailed):
    """The training loss became NaN or infinite: every rank stops (exit 1) with the line saying what to change (it
    trained on and wrote a NaN model and summary, exit 0)."""


class StepProgress(Protocol):
    """Where rank 0 shows its progress (cli/progress.StepBar: a bar on a terminal, plain lines elsewhere)."""

    def line(self, message: str) -> None:
        """Print one line."""

    def shows_steps(self) -> bool:
        """Whether each step is shown (a bar on a terminal), so its loss is worth reading at once."""

    def step(self, done: int, total: int, note: str = "") -> None:
        """``done`` of ``total`` steps, ``note`` beside them."""

    def close(self) -> None:
        """The run ended: take any bar down."""


class LossReadout:
    """The latest step loss already on the host, for the bar: on a GPU it is copied over without waiting for the
    step (the bar shows a loss one or two steps old), as a wait per step would leave the GPU idle between steps."""

    def __init__(self, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self.value = math.nan
        self.pending: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def latest(self, step_loss: torch.Tensor) -> float:
        """This step's loss on the CPU; on a GPU, the newest loss whose copy has arrived (NaN before the first)."""
        if not self.on_gpu:
            return float(step_loss)
        if self.pending is not None and self.pending[1].query():
            self.value, self.pending = float(self.pending[0]), None
        if self.pending is None:
            host = torch.empty((), dtype=step_loss.dtype, pin_memory=True)
            host.copy_(step_loss.detach(), non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(torch.cuda.current_stream(step_loss.device))  # the stream the copy was queued on
            self.pending = (host, arrived)
        return self.value


class Trainer:
    """Trains one model with the layout in ``config.parallel`` on the current process group.

    Every rank constructs a Trainer and calls :meth:`run`; only rank 0 prints and writes run outputs
    (DCP checkpoints are written collectively, each rank its own shards).
    """

    def __init__(self, config: TrainConfig, model_fn: Callable[[], nn.Module], data: TrainData,
                 info: DistInfo, progress: StepProgress | None = None, data_shape: dict | None = None) -> None:
        """Check the configuration, build the mesh, parallelize the model and build the optimizers; rank 0 shows
        its progress on ``progress`` (plain lines on standard output when None). ``data_shape``: what the data told
        the model (its checkpoints keep it: a resume from another --data-path's is refused before any rank starts)."""
        self.data_shape = data_shape
        if not isinstance(config.parallel, ParallelLayout):  # not resolved by a launcher: this path starts here
            config = config.resolved(info.world_size, info.device.type)
        config.parallel.check_runs_on(info.world_size, info.device.type)
        self.config, self.data, self.info, self.progress = config, data, info, progress
        self.out = Path(config.out)
        pc = config.parallel
        self.precision = pc.precision
        self.mesh = build_mesh(pc, info.device.type)
        self.loss_fn = classification_loss if data.task == CLASSIFICATION else language_model_loss
        self.model = parallelize(model_fn, config.model, pc, self.mesh, info, self.loss_fn, config.seed,
                                 config.activation_checkpointing, config.compile)
        self.optimizers = build_optimizers(self.model.parts, config, info.device.type)
        self.local_batch = config.batch_size // pc.data_parallel_size
        dp_rank, dp_size = self.mesh.data_parallel_rank, pc.data_parallel_size
        self.sampler = DistributedBatchSampler(len(data.train_inputs), self.local_batch, dp_size, dp_rank,
                                               shuffle=True, seed=config.seed)
        self.eval_sampler = DistributedBatchSampler(len(data.eval_inputs), self.local_batch, dp_size, dp_rank,
                                                    shuffle=False)
        # Rank that reports a loss for its data shard: the last pipeline stage, first tensor-parallel rank.
        self.reports_loss = self.model.has_last_stage and self.mesh.coord("tp") == 0
        self.loss_readout = LossReadout(info.device)
        self.counters = dict(COUNTERS)
        self.stepped = False  # whether a step was taken: what keep_model keeps
        self.pp_group = self.mesh["pp"].get_group() if pc.pp > 1 else None

    # ----------------------------------------------------------------------------------------- helpers
    def _log(self, message: str) -> None:
        if self.info.is_main:
            if self.progress is not None:
                self.progress.line(message)
            else:
                print(message, flush=True)

    def _sum_over_reporters(self, values: list[float]) -> list[float]:
        t = torch.tensor(values if self.reports_loss else [0.0] * len(values), dtype=torch.float64,
                         device=self.info.device)
        dist.all_reduce(t)
        return t.tolist()

    def _interval_loss(self, interval_loss: torch.Tensor | float, steps: int) -> float:
        """The loss of the ``steps`` since the last logged one (``interval_loss``: this rank's sum) as a checkpoint
        keeps it: their mean over the ranks that report a loss, times ``steps`` (collective)."""
        if not steps:
            return 0.0
        loss_sum, reporters = self._sum_over_reporters([float(interval_loss) / steps, 1.0])
        return loss_sum / reporters * steps

    def _autocast(self) -> contextlib.AbstractContextManager:
        # Only the plain (non-FSDP, non-pipeline) path on GPUs; FSDP2 casts by itself (precision.py).
        if uses_autocast(self.config.parallel):
            return torch.autocast(self.info.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, indices: list[int], inputs: torch.Tensor, targets: torch.Tensor):
        idx = torch.tensor(indices)
        x, y = inputs[idx], targets[idx]
        if self.info.device.type == "cuda":  # pinned, so the copy runs beside the GPU's queued work
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.info.device, non_blocking=True), y.to(self.info.device, non_blocking=True)

    # -------------------------------------------------------------------------------------- one step
    def _diverged(self, loss: float, step: int) -> str:
        """The line a NaN or infinite training loss at ``step`` stops the run with: the likely cause, what to change."""
        said = f"the training loss is {loss} at step {step} (lr {self.optimizers[0].param_groups[0]['lr']:g})"
        hint = scale_hint(self.data.train_inputs) if self.data.task == CLASSIFICATION else ""
        if hint:
            return f"{said}: training diverged, {hint}; else lower --lr, or set --grad-clip"
        return f"{said}: training diverged; lower --lr, or set --grad-clip"

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward, backward (accumulated), clip and optimizer step on this rank's batch; returns its loss as a
        0-d tensor on the device (reading it waits for the step: the loop reads it once per log interval)."""
        pipeline = self.model.pipeline
        if pipeline is not None:
            losses: list[torch.Tensor] = []
            pipeline.step(x, y, losses=losses, return_outputs=False)
            loss = torch.stack(losses).detach().mean() if losses else torch.zeros((), device=self.info.device)
        else:
            model, accum = self.model.parts[0], self.config.grad_accum
            loss = torch.zeros((), device=self.info.device)
            for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
                last = i == accum - 1
                if is_fsdp(model):
                    model.set_requires_gradient_sync(last)
                sync = model.no_sync() if is_ddp(model) and not last else contextlib.nullcontext()
                with sync:
                    with self._autocast():
                        micro_loss = self.loss_fn(model(xm), ym) / accum
                    micro_loss.backward()
                loss += micro_loss.detach().float()
        replicate_partial_grads(self.model.parameters())
        if self.config.grad_clip > 0:
            clip_gradients(self.model.parameters(), self.config.grad_clip, self.pp_group)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    # ------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss (and accuracy for classifiers) over the evaluation set, exact despite padding to equal batches.

        Padded examples (repeats that give every rank the same number of batches) are masked out, with or
        without a pipeline; only the ranks that report losses (last stage, first TP rank) are counted.
        """
        for part in self.model.parts:
            part.eval()
        limit = self.config.eval_batches if self.data.task != CLASSIFICATION else 0
        loss_sum = correct = count = 0.0
        self.eval_sampler.set_epoch(0)
        for b, (indices, valid) in enumerate(self.eval_sampler.iter_with_padding_mask()):
            if limit and b >= limit:
                break
            x, y = self._to_device(indices, self.data.eval_inputs, self.data.eval_targets)
            pipeline = self.model.pipeline
            if pipeline is not None:
                # The last stage gets the merged logits of all microbatches back; other stages get None.
                out = pipeline.eval(x, y)
                if out is None:
                    continue
            else:
                with self._autocast():
                    out = self.model.parts[0](x)
            valid = valid.to(self.info.device)
            if self.data.task == CLASSIFICATION:
                per_example = classification_loss(out, y, reduction="none")
                correct += float(((out.argmax(-1) == y) & valid).sum())
            else:
                per_example = language_model_loss(out, y, reduction="none").view(y.shape).mean(1)
            loss_sum += float((per_example * valid).sum())
            count += float(valid.sum())
        for part in self.model.parts:
            part.train()
        loss_sum, correct, count = self._sum_over_reporters([loss_sum, correct, count])
        if self.data.task == CLASSIFICATION:
            return {"test_loss": loss_sum / count, "test_accuracy": correct / count}
        return {"val_loss": loss_sum / count}

    # ------------------------------------------------------------------------------------ checkpoints
    def _checkpoint_dir(self) -> Path:
        return self.out / "checkpoints"

    def save(self) -> Path:
        """Collectively checkpoint model, optimizer, counters and RNG."""
        return save_checkpoint(self._checkpoint_dir(), self.model.parts, self.optimizers, dict(self.counters),
                               record=run_record(self.config, self.data_shape))

    def maybe_resume(self) -> int:
        """Load the latest checkpoint of this run directory if there is one; returns the step resumed from."""
        if not self.config.resume:
            return 0
        path = latest_checkpoint(self._checkpoint_dir())
        if path is None:
            return 0
        self.counters.update(load_checkpoint(path, self.model.parts, self.optimizers, COUNTERS))
        self._log(f"resumed from {path} at step {self.counters['step']}")
        return self.counters["step"]

    # --------------------------------------------------------------------------------------- the loop
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: ``max_steps`` if set, else epochs x batches per epoch."""
        if self.config.max_steps > 0:
            return self.config.max_steps
        return self.config.epochs * len(self.sampler)

    def run(self, stop_after_steps: int | None = None) -> dict[str, Any] | None:
        """Train to the end and return the summary (on every rank; rank 0 also writes it).

        ``stop_after_steps`` abandons the run right after that step without saving anything, as a crash
        would (used to test resuming).
        """
        cfg, c = self.config, self.counters
        wall_start = time.perf_counter()
        reset_peak_memory(self.info.device)
        resumed_from = self.maybe_resume()
        log = StepMetricsLog(self.out, self.info.is_main, resumed_from, cfg.tensorboard)
        total = self.total_steps()
        global_batch = cfg.batch_size
        base_lr = cfg.scaled_lr()
        train_seconds, run_samples, last_eval_step = 0.0, 0, -1
        last_loss, loss_step, evals = float("nan"), None, {}
        finished = bool(resumed_from) and c["step"] >= total  # a finished run resumed, or a lower --max-steps
        if finished:
            self._log(f"the checkpoint is at step {c['step']}, already at or after the run's last step {total}: "
                      f"nothing to train (raise {'--max-steps' if cfg.max_steps > 0 else '--epochs'} to train on, or "
                      "pass --no-resume to start afresh)")
            kept = self._finished_outputs()
            if kept is not None:
                log.close()
                if self.progress is not None:
                    self.progress.close()
                self._log(f"its outputs in {self.out} are left as they are")
                return kept
            last_loss, loss_step = next(((r["loss"], r["step"]) for r in reversed(log.records())
                                         if r.get("kind") == "train"), (last_loss, loss_step))
        else:
            self._log(f"training {cfg.model} on {cfg.dataset}: world {self.info.world_size} "
                      f"(dp {cfg.parallel.dp}, fsdp {cfg.parallel.fsdp}, tp {cfg.parallel.tp}, pp {cfg.parallel.pp}), "
                      f"{total - c['step']} steps of {global_batch} examples to step {total}, lr {base_lr:g}, "
                      f"{self.precision}")
        first_step, steps_start = c["step"], time.perf_counter()  # the pace of this process's steps: the time left
        # No wait for the GPU inside a log interval: the losses add up on it, and the interval's time counts once
        # its loss is read (evaluations and checkpoints are taken off its clock).
        interval_start, interval_steps = time.perf_counter(), 0
        # the interval's loss and its steps, those before a resume included (interval_steps: this process's, timed)
        interval_loss, loss_steps = c["interval_loss"], c["interval_steps"]
        while c["step"] < total:
            self.sampler.set_epoch(c["epoch"], start_batch=c["batch_in_epoch"])
            for indices in self.sampler:
                with held_stops():  # SIGINT/SIGTERM stops the run between steps: keep_model keeps a whole step's
                    x, y = self._to_device(indices, self.data.train_inputs, self.data.train_targets)
                    set_learning_rate(self.optimizers, base_lr * warmup_factor(c["step"], cfg.warmup_steps))
                    step_loss = self.train_step(x, y)
                    interval_loss += step_loss
                    c["step"] += 1
                    c["batch_in_epoch"] += 1
                    c["samples"] += global_batch
                    run_samples += global_batch
                    interval_steps += 1
                    loss_steps += 1
                    self.stepped = True
                if c["step"] % cfg.log_every == 0 or c["step"] == total:
                    loss_sum, reporters = self._sum_over_reporters([float(interval_loss) / loss_steps, 1.0])
                    last_loss, loss_step = loss_sum / reporters, c["step"]
                    if not math.isfinite(last_loss):  # the same on every rank: summed over them
                        raise TrainingDiverged(self._diverged(last_loss, c["step"]))
                    elapsed = max(time.perf_counter() - interval_start, 1e-9)
                    train_seconds += elapsed
                    rate = interval_steps * global_batch / elapsed
                    log.write({"kind": "train", "step": c["step"], "epoch": c["epoch"], "loss": last_loss,
                               "lr": self.optimizers[0].param_groups[0]["lr"], "samples_per_second": rate})
                    left = (time.perf_counter() - steps_start) / (c["step"] - first_step) * (total - c["step"])
                    self._log(f"epoch {c['epoch']} step {c['step']}/{total} loss {last_loss:.4f} "
                              f"{rate:.0f} samples/s, about {left:.0f} s left")
                    interval_start, interval_steps, interval_loss, loss_steps = time.perf_counter(), 0, 0.0, 0
                if self.progress is not None and self.info.is_main:
                    self._show_step(total, step_loss, last_loss)
                if cfg.checkpoint_every and c["step"] % cfg.checkpoint_every == 0:
                    c["interval_steps"], c["interval_loss"] = loss_steps, self._interval_loss(interval_loss, loss_steps)
                    interval_start += self._off_the_clock(self.save)[1]
                if stop_after_steps is not None and c["step"] >= stop_after_steps:
                    if self.progress is not None:
                        self.progress.close()
                    return None
                if c["step"] >= total:
                    break
            if c["batch_in_epoch"] >= len(self.sampler):
                evals, seconds = self._off_the_clock(self.evaluate)
                interval_start += seconds
                last_eval_step = c["step"]
                log.write({"kind": "eval", "step": c["step"], "epoch": c["epoch"], **evals})
                self._log(f"epoch {c['epoch']} done: " + ", ".join(f"{k} {v:.4f}" for k, v in evals.items()))
                c["epoch"] += 1
                c["batch_in_epoch"] = 0
        if last_eval_step != c["step"]:
            evals = self.evaluate()  # for the summary; the row only once per step (a resumed run may have it)
            if not any(r.get("kind") == "eval" and r.get("step") == c["step"] for r in log.records()):
                log.write({"kind": "eval", "step": c["step"], "epoch": c["epoch"], **evals})
        if cfg.checkpoint_every and c["step"] % cfg.checkpoint_every and not finished:
            c["interval_steps"], c["interval_loss"] = 0, 0.0  # the last step's row was logged
            self.save()
        if self.progress is not None:
            self.progress.close()
        return self._finish(log, evals, (last_loss, loss_step), wall_start, train_seconds, run_samples, resumed_from)

    def _show_step(self, total: int, step_loss: torch.Tensor, last_loss: float) -> None:
        """Rank 0 shows the step just done with its loss (on its data shard; on a GPU the newest one that arrived), or
        the last logged loss where rank 0 holds none (a pipeline's first stage); only a bar on a terminal reads it."""
        if not self.progress.shows_steps():
            return
        loss = self.loss_readout.latest(step_loss) if self.reports_loss else last_loss
        self.progress.step(self.counters["step"], total, f"loss {loss:.4f}" if math.isfinite(loss) else "")

    def _finished_outputs(self) -> dict[str, Any] | None:
        """Collectively, for a finished run resumed: the summary.json it wrote (``{}`` on the other ranks) when rank 0
        finds it and its final model in --out, else None (it was stopped before writing them: they are written)."""
        from fedpar.protocol.model_file import INFO, TENSORS

        summary = None
        if self.info.is_main and all((self.out / name).is_file() for name in (TENSORS, INFO)):
            try:
                summary = json.loads((self.out / "summary.json").read_text())
            except (OSError, ValueError):
                summary = None
            if not isinstance(summary, dict) or summary.get("steps") != self.counters["step"]:
                summary = None
        found = torch.tensor([summary is not None], dtype=torch.int32, device=self.info.device)
        dist.broadcast(found, src=0)
        return (summary or {}) if found.item() else None

    def _off_the_clock(self, work: Callable[[], Any]) -> tuple[Any, float]:
        """``work()``'s result and its seconds, once the training steps queued before it are done."""
        synchronize(self.info.device)
        start = time.perf_counter()
        return work(), time.perf_counter() - start

    def _finish(self, log: StepMetricsLog, evals: dict[str, float], last_loss: tuple[float, int | None],
                wall_start: float, train_seconds: float, run_samples: int, resumed_from: int) -> dict[str, Any]:
        """Write summary.json, metrics.csv, the final model and the loss curve; the summary. ``last_loss``: the last
        logged train loss and its step."""
        peak, source = peak_memory_bytes(self.info.device)
        peaks = gather_ints(peak, self.info.device)
        states = gather_ints(model_state_bytes(self.model.parts, self.optimizers), self.info.device)
        summary: dict[str, Any] = {
            "model": self.config.model,
            "dataset": self.config.dataset,
            "world_size": self.info.world_size,
            "backend": self.info.backend,
            "device": str(self.info.device),
            "precision": self.precision,
            "steps": self.counters["step"],
            "resumed_from_step": resumed_from,
            # an interrupted run's summary says the same of its last evaluation and logged step, earlier than "steps"
            "evaluated_at_step": self.counters["step"],  # evals: at the last step (evaluated once more if need be)
            **evals,
            "final_train_loss": last_loss[0],
            "train_loss_at_step": last_loss[1],  # the last step's, unless a finished run resumed at an unlogged one
            "wall_seconds": time.perf_counter() - wall_start,
            "train_seconds": train_seconds,
            "samples_per_second": run_samples / train_seconds if train_seconds else 0.0,
            "peak_memory_bytes": peaks,
            "peak_memory_source": source,
            "model_state_bytes": states,
            "config": self.config.to_dict(),
        }
        log.close()
        written = self._write_final_model(evals)
        if self.info.is_main:
            write_json_atomic(self.out / "summary.json", summary)
            if self.config.plot:
                plot_loss_curve(log.records(), self.out / "loss_curve.png",
                                f"{self.config.model} on {self.config.dataset}, world {self.info.world_size}")
            self._log(f"wrote summary.json, metrics.jsonl, metrics.csv{', ' + written if written else ''}"
                      f"{' and loss_curve.png' if self.config.plot else ''} in {self.out}")
        return summary

    def keep_model(self) -> int | None:
        """After a stop signal (parallel/stopping.py) between the steps of a run on one process: write the model of
        the last whole step as the finished run's; that step, or None when nothing was written (before the first
        step, or several ranks)."""
        if not self.stepped or self.info.world_size > 1:  # several ranks: the others are stopped, no gathering
            return None
        self._write_final_model({}, interrupted=True)
        return self.counters["step"]

    def _model_kwargs(self) -> dict[str, Any]:
        """The keywords the model was built with, what the data implied included: global.json alone rebuilds it."""
        if self.data_shape is None:  # a model_fn of the caller's own, told nothing by the data
            return dict(self.config.model_kwargs)
        return model_kwargs_for(self.config.model, self.data_shape, self.config.model_kwargs)

    def _write_final_model(self, evals: dict[str, float], interrupted: bool = False) -> str:
        """Collectively gather the whole model to rank 0 (a pipeline's stages too), which writes it as
        OUT/global.safetensors and global.json (protocol/model_file.py, as ``train --task`` and federated runs keep
        theirs; ``round``: the epochs completed); what was written, for the last line."""
        if self.config.parallel.pp > 1:
            leader = all(self.mesh.coord(dim) == 0 for dim in ("dp", "fsdp", "tp"))
            full = gather_pipeline_state_dict(self.model.parts, self.pp_group, leader, self.info.device)
        else:
            full = gather_full_state_dict(self.model.parts[0])
        if not self.info.is_main:
            return ""
        from fedpar.protocol.model_file import INFO, TENSORS, write_final_model

        floats = [(name, t) for name, t in full.items() if torch.is_floating_point(t)]
        epochs = self.counters["epoch"]
        write_final_model(self.out, [name for name, _ in floats], [t.float().numpy() for _, t in floats],
                          max(epochs, 1), {"model": self.config.model, "dataset": self.config.dataset,
                                           "model_kwargs": self._model_kwargs()},
                          {"round": epochs, "step": self.counters["step"], **evals}, interrupted)
        return f"{TENSORS}, {INFO}"
