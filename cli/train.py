"""Centralized training on the parallel engine: DDP, FSDP (HSDP), tensor/sequence and pipeline parallelism.

One process by default; --nproc N spawns N local ranks (gloo on CPU, NCCL on GPUs). Under torchrun
(RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) every launched process is one rank, e.g.
`torchrun --nnodes 2 --nproc-per-node 8 ... -m fedpar train --model gpt --dataset text --fsdp 8 --tp 2 ...`.
Writes OUT/metrics.jsonl, OUT/summary.json, OUT/loss_curve.png and (with --checkpoint-every) resumable
DCP checkpoints in OUT/checkpoints. --config FILE reads a [train] table and its nested tables: [train.parallel]
holds the parallel options (tp = 2 as --tp 2) and [train.model_kwargs] the model's keywords; flags override.
Layout errors (degrees, pipeline stages vs blocks, heads vs --tp, bf16 with nothing to apply it) stop the
launcher before any rank starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from fedpar.cli.argtypes import count, non_negative, non_negative_int, positive
from fedpar.cli.observability import add_tensorboard_argument
from fedpar.parallel.config import (
    LR_SCALING_RULES,
    MIXED_PRECISION,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    ConfigurationError,
    ParallelConfig,
    TrainConfig,
)
from fedpar.parallel.device import DEVICE_HELP

_T, _P = TrainConfig(), ParallelConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fedpar train`` (defaults are those of TrainConfig / ParallelConfig)."""
    run = parser.add_argument_group("run")
    run.add_argument("--model", default=_T.model, choices=("mlp", "cnn", "gpt"), help="model from the zoo")
    run.add_argument("--dataset", default=_T.dataset, choices=("digits", "mnist", "text"),
                     help="digits (bundled), mnist (needs --data-path DIR) or text (any UTF-8 file, for gpt)")
    run.add_argument("--data-path", default=_T.data_path,
                     help="MNIST folder or text file, e.g. ../shared/data/tinyshakespeare/input.txt")
    run.add_argument("--out", default=_T.out, help="run directory for metrics, summary, plot and checkpoints")
    run.add_argument("--nproc", type=count, default=1, help="local ranks to spawn (ignored under torchrun)")
    run.add_argument("--device", default=_T.device, help=DEVICE_HELP)
    run.add_argument("--timeout", type=positive, default=300.0, help="seconds a collective may wait before failing")
    run.add_argument("--seed", type=int, default=_T.seed, help="seed for the weights and the data order")
    run.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                     help="model constructor keyword, e.g. n_layer=4 or hidden=[256,128] (repeatable)")
    run.add_argument("--block-size", type=count, default=_T.block_size, help="context length for text")
    # No flag: a --config file's [train.model_kwargs] table lands here; --model-arg entries override it.
    parser.set_defaults(model_kwargs={})
    opt = parser.add_argument_group("optimisation")
    opt.add_argument("--epochs", type=count, default=_T.epochs, help="passes over the training set")
    opt.add_argument("--max-steps", type=non_negative_int, default=_T.max_steps, help="stop after this many steps (0: epochs)")
    opt.add_argument("--batch-size", type=count, default=_T.batch_size, help="global batch size per optimizer step")
    opt.add_argument("--lr", type=positive, default=_T.lr, help="learning rate at --base-batch-size")
    opt.add_argument("--base-batch-size", type=non_negative_int, default=_T.base_batch_size,
                     help="batch size --lr was tuned for (0: no scaling)")
    opt.add_argument("--lr-scaling", default=_T.lr_scaling, choices=LR_SCALING_RULES,
                     help="scale the lr with batch-size/base-batch-size linearly or by its square root")
    opt.add_argument("--warmup-steps", type=non_negative_int, default=_T.warmup_steps, help="linear learning-rate warmup steps")
    opt.add_argument("--optimizer", default=_T.optimizer, choices=OPTIMIZERS, help="optimizer")
    opt.add_argument("--optimizer-impl", default=_T.optimizer_impl, choices=OPTIMIZER_IMPLS,
                     help="torch optimizer kernels; auto: fused AdamW (CPU and GPU), torch's default for SGD")
    opt.add_argument("--momentum", type=non_negative, default=_T.momentum, help="SGD momentum")
    opt.add_argument("--weight-decay", type=non_negative, default=_T.weight_decay, help="weight decay")
    opt.add_argument("--grad-accum", type=count, default=_T.grad_accum, help="microbatches accumulated per step")
    opt.add_argument("--grad-clip", type=non_negative, default=_T.grad_clip, help="max global gradient norm (0: off)")
    opt.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction,
                     default=_T.activation_checkpointing, help="recompute block activations in backward")
    opt.add_argument("--compile", action=argparse.BooleanOptionalAction, default=_T.compile,
                     help="torch.compile each transformer block (the whole forward of other models)")
    out = parser.add_argument_group("outputs")
    out.add_argument("--eval-batches", type=non_negative_int, default=_T.eval_batches,
                     help="validation batches per evaluation for text (0: all)")
    out.add_argument("--log-every", type=count, default=_T.log_every, help="steps between progress lines")
    out.add_argument("--checkpoint-every", type=non_negative_int, default=_T.checkpoint_every,
                     help="steps between DCP checkpoints (0: none)")
    out.add_argument("--resume", action=argparse.BooleanOptionalAction, default=_T.resume,
                     help="continue from OUT/checkpoints/latest if it exists")
    out.add_argument("--plot", action=argparse.BooleanOptionalAction, default=_T.plot, help="write loss_curve.png")
    add_tensorboard_argument(out)
    par = parser.add_argument_group("parallelism (dp*fsdp*tp*pp = world size; -1 infers one degree)")
    par.add_argument("--dp", type=int, default=_P.dp, help="replicas (DDP, or HSDP's replicate dim with --fsdp)")
    par.add_argument("--fsdp", type=int, default=_P.fsdp, help="FSDP2 shards")
    par.add_argument("--tp", type=int, default=_P.tp, help="tensor-parallel degree (mlp, gpt)")
    par.add_argument("--pp", type=int, default=_P.pp, help="pipeline stages across ranks (gpt)")
    par.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=_P.sequence_parallel,
                     help="shard norms/activations along the sequence with --tp")
    par.add_argument("--mixed-precision", default=_P.mixed_precision, choices=MIXED_PRECISION,
                     help="auto: bf16 params + fp32 reduce on GPU, fp32 on CPU")
    par.add_argument("--cpu-offload", action=argparse.BooleanOptionalAction, default=_P.cpu_offload,
                     help="keep FSDP shards in CPU memory")
    par.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction,
                     default=_P.reshard_after_forward, help="free gathered FSDP params after forward")
    par.add_argument("--pp-schedule", default=_P.pp_schedule, choices=PIPELINE_SCHEDULES, help="pipeline schedule")
    par.add_argument("--microbatches", type=count, default=_P.microbatches, help="pipeline microbatches per step")
    par.add_argument("--stages-per-rank", type=count, default=_P.stages_per_rank,
                     help="pipeline stages per rank (2+ for interleaved1f1b)")


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the parsed options describe."""
    kwargs: dict[str, Any] = dict(getattr(args, "model_kwargs", None) or {})
    for item in args.model_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"--model-arg {item!r} must look like KEY=VALUE, e.g. n_layer=4")
        kwargs[key.strip()] = _parse_value(value.strip())
    par = {f.name: getattr(args, f.name) for f in dataclasses.fields(ParallelConfig)}
    train = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
             if f.name not in ("parallel", "model_kwargs")}
    return TrainConfig(**train, model_kwargs=kwargs, parallel=ParallelConfig(**par))


def run(args: argparse.Namespace) -> int:
    """Validate (layout, precision, model shape against the degrees), then train here or in ``--nproc`` ranks."""
    from fedpar.parallel.device import check_device_layout
    from fedpar.parallel.init import exit_rank_process, spawn
    from fedpar.parallel.preflight import preflight
    from fedpar.parallel.run import spawned_train_process, train_process

    from fedpar.cli.observability import require_tensorboard
    from fedpar.cli.user_errors import check_output_folder

    check_output_folder(args.out)
    if args.tensorboard:
        require_tensorboard()  # a missing package is said before any rank starts
    under_launcher = "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_launcher else args.nproc
    try:
        cfg = config_from_args(args)
        cfg.parallel = cfg.parallel.resolved(world)
        cfg.check()
        # One GPU per rank on this machine: torchrun's LOCAL_WORLD_SIZE, else the ranks spawned here.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_launcher else world
        preflight(cfg, check_device_layout(cfg.device, local_ranks))
    except (ConfigurationError, ValueError, FileNotFoundError) as exc:  # data and model errors too
        print(f"fedpar train: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        if world > 1 and not under_launcher:
            spawn(world, spawned_train_process, cfg.to_dict(), args.timeout, parent_stops=True)
        else:
            train_process(cfg, args.timeout)
            if under_launcher:
                exit_rank_process(0)  # a finished torchrun rank leaves without the teardown that can abort
    except KeyboardInterrupt:  # Ctrl-C: the ranks are stopped; say what completed
        if int(os.environ.get("RANK", "0")):
            return 130
        from fedpar.parallel.metrics import write_interrupted_summary
        summary = write_interrupted_summary(Path(cfg.out), cfg.model, cfg.dataset, world,
                                            time.perf_counter() - started, cfg.to_dict())
        print(f"fedpar train: interrupted after {summary['steps']} logged steps; wrote {cfg.out}/summary.json",
              file=sys.stderr)
        return 130
    return 0
