"""Checks the launcher runs once before any rank starts, so a bad layout fails in a second, not after spawning."""

from __future__ import annotations

import torch

from fedpar.datasets.registry import load_train_data
from fedpar.models import build_model
from fedpar.models.for_data import model_kwargs_for
from fedpar.parallel.compile import check_compile_layout
from fedpar.parallel.config import TrainConfig
from fedpar.parallel.parallelize import check_model_layout
from fedpar.wording import counted


def preflight(config: TrainConfig) -> dict:
    """Check data and model shape against the layout ``config`` was resolved into (TrainConfig.resolved); what the
    data tells the model (e.g. a text's ``vocab_size``), which a resume must match.

    The data is read here too (every rank reads it again), so that a missing --data-path, a model that does not fit
    the data or a --model-arg it does not take is said in one line before any rank starts; the model is built on
    the meta device (no memory, no init cost).
    """
    pc = config.parallel
    if config.compile:
        check_compile_layout(config.model, pc)
    data, implied = load_train_data(config.dataset, config.data_path, config.block_size, config.seed)
    kwargs = model_kwargs_for(config.model, implied, config.model_kwargs)
    with torch.device("meta"):
        model = build_model(config.model, **kwargs)
    if pc.tp > 1 or pc.pp > 1:
        check_model_layout(model, config.model, pc)
    examples = len(data.train_inputs)
    if config.batch_size > examples:  # each step would repeat the set to fill its batch (10^12: a MemoryError)
        raise ValueError(f"--batch-size {config.batch_size} is more than the {counted(examples, 'training example')} "
                         f"of --dataset {config.dataset}; give --batch-size {examples} or less")
    return implied
