"""One training process end to end: join the group, load data and the zoo model, train, leave the group."""

from __future__ import annotations

from typing import Any

import torch

from fedpar.datasets.registry import load_train_data
from fedpar.models import build_model
from fedpar.models.for_data import model_kwargs_for
from fedpar.parallel.config import TrainConfig, train_config_from_dict
from fedpar.parallel.init import init_distributed, shutdown_distributed
from fedpar.parallel.trainer import StepProgress, Trainer
from fedpar.parallel.device import flush_denormals


def train_process(config: dict[str, Any] | TrainConfig, timeout_seconds: float = 300.0,
                  progress: StepProgress | None = None) -> dict[str, Any]:
    """Train with ``config`` in this process (one rank of a torchrun/spawned group, or alone), rank 0 showing its
    progress on ``progress``; returns the summary."""
    cfg = config if isinstance(config, TrainConfig) else train_config_from_dict(config)
    flush_denormals()
    info = init_distributed(timeout_seconds, cfg.device)
    try:
        data, implied = load_train_data(cfg.dataset, cfg.data_path, cfg.block_size, cfg.seed)
        kwargs = model_kwargs_for(cfg.model, implied, cfg.model_kwargs)
        trainer = Trainer(cfg, lambda: build_model(cfg.model, **kwargs), data, info, progress, data_shape=implied)
        try:
            summary = trainer.run() or {}
        except KeyboardInterrupt as exc:  # SIGINT or SIGTERM, between two steps: keep the model trained so far
            exc.kept_step = trainer.keep_model()
            raise
        # Leave together: rank 0 hosts the rendezvous store, and a peer still using it when rank 0 tears it
        # down aborts ("terminate called without an active exception", seen under load).
        if torch.distributed.is_initialized() and info.world_size > 1:
            torch.distributed.barrier()
        return summary
    finally:
        if progress is not None:  # a stop or an error: the bar down (the cursor shown) before the line said of it
            progress.close()
        shutdown_distributed()


def spawned_train_process(config: TrainConfig, timeout_seconds: float, progress: StepProgress | None = None) -> None:
    """Entry point for ``spawn``: ``config`` as the launcher resolved it (its layout is used as is); the summary is
    written to disk by rank 0, so nothing is returned."""
    train_process(config, timeout_seconds, progress)
