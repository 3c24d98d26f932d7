"""Checks the launcher runs once before any rank starts, so a bad layout fails in a second, not after spawning."""

from __future__ import annotations

import torch

from fedpar.datasets.arrays import TrainData
from fedpar.datasets.memory import check_fits
from fedpar.datasets.registry import load_train_data
from fedpar.models import build_model
from fedpar.models.for_data import model_kwargs_for
from fedpar.parallel.compile import check_compile_layout
from fedpar.parallel.config import TrainConfig
from fedpar.wording import counted


def preflight(config: TrainConfig, spawned: int = 0) -> dict:
    """Check data and model shape against the layout ``config`` was resolved into (TrainConfig.resolved), and that the
    ``spawned`` ranks to be started here fit this machine's memory; what the data tells the model (e.g. a text's
    ``vocab_size``), which a resume must match.

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
        # (imported here: torch's pipelining and DTensor take 1.6 s of CPU to import, which the aggregator ranks'
        # memory check, server/ranks/memory.py, has no use for)
        from fedpar.parallel.parallelize import check_model_layout

        check_model_layout(model, config.model, pc)
    if spawned:
        check_train_ranks_fit(config, spawned, sum(p.numel() for p in model.parameters()), data_bytes(data))
    examples = len(data.train_inputs)
    if config.batch_size > examples:  # each step would repeat the set to fill its batch (10^12: a MemoryError)
        raise ValueError(f"--batch-size {config.batch_size} is more than the {counted(examples, 'training example')} "
                         f"of --dataset {config.dataset}; give --batch-size {examples} or less")
    return implied


# A rank started here: its share of the interpreter, torch and gloo once forked (8 digits ranks took 1 GiB in all)
RANK_BYTES = 100 << 20
STATE_BYTES_PER_PARAMETER = 16  # fp32 weights, their gradients and an optimizer's two moments


def check_ranks_fit(ranks: int, what: str, advice: str, parameters: int = 0, *, rank_bytes: int = RANK_BYTES,
                    parameter_bytes: int = STATE_BYTES_PER_PARAMETER, data: int = 0) -> None:
    """ValueError, one line before they start, when the ``ranks`` processes to be started on this machine (``what``
    they are for; ``advice``: what to do instead) need more memory than it has available: each holds its process
    (``rank_bytes``), ``data`` bytes of data and ``parameter_bytes`` for each of the ``parameters`` of its share of
    a model."""
    check_fits(ranks * (rank_bytes + data + parameter_bytes * parameters), what, advice)


def check_train_ranks_fit(config: TrainConfig, ranks: int, parameters: int, data: int = 0,
                          model: str = "model (--model-arg)") -> None:
    """:func:`check_ranks_fit` for the ``ranks`` processes --nproc asks for here (1: this one) of ``config``'s
    layout: each holds the whole data (``data`` bytes) and its shard of the ``model``'s ``parameters`` with their
    gradients and optimizer state (on the CPU)."""
    pc = config.parallel
    # on a GPU the model's state is the device's, not this machine's memory
    shard = parameters // (pc.fsdp * pc.tp * pc.pp) if pc.device_type == "cpu" else 0
    if ranks == 1:
        what = "training in this process"
        advice = f"give a smaller {model}, or shard it over machines with torchrun and --fsdp"
    else:
        what = f"training on {ranks} ranks here (--nproc {ranks})"
        advice = "give a smaller --nproc or model, or spread the ranks over machines with torchrun"
    check_ranks_fit(ranks, what, advice, shard, data=data)


def data_bytes(data: TrainData) -> int:
    """The bytes of ``data``'s training and evaluation tensors, which every rank loads."""
    return sum(t.nbytes for t in (data.train_inputs, data.train_targets, data.eval_inputs, data.eval_targets))
