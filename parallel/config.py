"""Engine configuration: parallel degrees and training settings as dataclasses, from flat keys or overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
LR_SCALING_RULES = ("none", "linear", "sqrt")
MIXED_PRECISION = ("auto", "fp32", "bf16")
OPTIMIZERS = ("sgd", "adamw")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")


class ConfigurationError(ValueError):
    """A setting that cannot work, with a message that says what to change."""


def interleaved_microbatches_fit(microbatches: int, pp: int) -> bool:
    """torch's ScheduleInterleaved1F1B rule: microbatches divisible by its rounds, max(1, microbatches // pp)."""
    return microbatches % max(1, microbatches // pp) == 0


@dataclass
class ParallelConfig:
    """Degrees of each parallelism (their product is the world size) and how they are applied.

    ``dp`` replicates (DDP, or the replicate dimension of HSDP when ``fsdp`` > 1), ``fsdp`` shards
    parameters with FSDP2, ``tp`` splits layers with DTensor tensor parallelism, ``pp`` splits the model
    into pipeline stages. One degree may be -1: it is then inferred from the world size.
    """

    dp: int = -1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = True
    mixed_precision: str = "auto"
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    pp_schedule: str = "1f1b"
    microbatches: int = 4
    stages_per_rank: int = 1

    def resolved(self, world_size: int) -> ParallelConfig:
        """A copy with the -1 degree filled in and every setting checked against ``world_size``."""
        degrees = {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp, "pp": self.pp}
        inferred = [k for k, v in degrees.items() if v == -1]
        bad = [f"--{k} {v}" for k, v in degrees.items() if v == 0 or v < -1]
        if bad:
            raise ConfigurationError(f"parallel degrees must be positive (or -1 to infer one): got {', '.join(bad)}")
        if len(inferred) > 1:
            raise ConfigurationError(
                f"only one degree may be -1 (inferred), got {', '.join('--' + k for k in inferred)}; set the others")
        known = 1
        for k, v in degrees.items():
            if v != -1:
                known *= v
        if inferred:
            if world_size % known:
                raise ConfigurationError(
                    f"cannot infer --{inferred[0]}: world size {world_size} is not divisible by the product "
                    f"{known} of the other degrees; choose degrees whose product divides {world_size}")
            degrees[inferred[0]] = world_size // known
        product = degrees["dp"] * degrees["fsdp"] * degrees["tp"] * degrees["pp"]
        if product != world_size:
            raise ConfigurationError(
                f"dp*fsdp*tp*pp = {degrees['dp']}*{degrees['fsdp']}*{degrees['tp']}*{degrees['pp']} = {product} "
                f"but the world size is {world_size}; change the degrees (or --nproc) so they multiply to it")
        out = dataclasses.replace(self, **degrees)
        out.check()
        return out

    def check(self) -> None:
        """Raise ConfigurationError for settings that are inconsistent among themselves."""
        if self.pp_schedule not in PIPELINE_SCHEDULES:
            raise ConfigurationError(f"--pp-schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, "
                                     f"got {self.pp_schedule!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ConfigurationError(f"--mixed-precision must be one of {', '.join(MIXED_PRECISION)}, "
                                     f"got {self.mixed_precision!r}")
        if self.microbatches < 1:
            raise ConfigurationError("--microbatches must be at least 1")
        interleaved = self.pp_schedule == "interleaved1f1b"
        if self.pp > 1 and interleaved and self.stages_per_rank < 2:
            raise ConfigurationError("the interleaved1f1b schedule needs --stages-per-rank 2 or more; "
                                     "set it, or use --pp-schedule 1f1b")
        if self.pp > 1 and not interleaved and self.stages_per_rank != 1:
            raise ConfigurationError(f"--stages-per-rank {self.stages_per_rank} needs --pp-schedule "
                                     "interleaved1f1b; set that or use --stages-per-rank 1")
        if self.pp > 1 and self.microbatches < self.pp:
            raise ConfigurationError(f"--microbatches {self.microbatches} is below --pp {self.pp}: the pipeline "
                                     f"would idle; use at least {self.pp} microbatches")
        if self.pp > 1 and interleaved and not interleaved_microbatches_fit(self.microbatches, self.pp):
            rounds = self.microbatches // self.pp
            below = next(m for m in range(self.microbatches - 1, 0, -1) if interleaved_microbatches_fit(m, self.pp))
            above = next(m for m in range(self.microbatches + 1, 2 * self.microbatches + self.pp)
                         if interleaved_microbatches_fit(m, self.pp))
            raise ConfigurationError(
                f"--microbatches {self.microbatches} does not fit the interleaved1f1b schedule at --pp {self.pp}: "
                f"torch runs it in {self.microbatches} // {self.pp} = {rounds} rounds and needs the microbatches to "
                f"be a multiple of the rounds; use --microbatches {below} or {above} (any multiple of --pp works)")
        if self.dp > 1 and self.fsdp == 1 and self.tp > 1:
            raise ConfigurationError("DDP (--dp) cannot replicate tensor-parallel (DTensor) parameters; "
                                     "use --fsdp for the data-parallel degree when --tp > 1")

    @property
    def data_parallel_size(self) -> int:
        """How many distinct batches one step consumes (replicas times shards)."""
        return self.dp * self.fsdp

    @property
    def num_stages(self) -> int:
        """Total number of pipeline stages."""
        return self.pp * self.stages_per_rank


@dataclass
class TrainConfig:
    """Everything the centralized trainer needs: model, data, optimisation and the parallel layout."""

    model: str = "mlp"
    dataset: str = "digits"
    device: str = "auto"  # auto | cpu | cuda | cuda:N (parallel/device.py)
    data_path: str = ""
    out: str = "runs/train"
    epochs: int = 1
    max_steps: int = 0
    batch_size: int = 64
    lr: float = 0.05
    base_batch_size: int = 0
    lr_scaling: str = "none"
    warmup_steps: int = 0
    optimizer: str = "sgd"
    optimizer_impl: str = "auto"
    momentum: float = 0.9
    weight_decay: float = 0.0
    grad_accum: int = 1
    grad_clip: float = 0.0
    activation_checkpointing: bool = False
    compile: bool = False
    seed: int = 0
    block_size: int = 64
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    eval_batches: int = 20
    log_every: int = 10
    checkpoint_every: int = 0
    resume: bool = True
    plot: bool = True
    tensorboard: str | None = None  # folder for TensorBoard events of the logged steps and evaluations (rank 0)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def check(self) -> None:
        """Raise ConfigurationError for inconsistent training settings."""
        if self.lr_scaling not in LR_SCALING_RULES:
            raise ConfigurationError(f"--lr-scaling must be one of {', '.join(LR_SCALING_RULES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigurationError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ConfigurationError(f"--optimizer-impl must be one of {', '.join(OPTIMIZER_IMPLS)}")
        if self.optimizer_impl == "fused" and self.optimizer == "sgd" and (
                self.parallel.fsdp > 1 or self.parallel.tp > 1):
            raise ConfigurationError("--optimizer-impl fused: torch has no fused SGD for sharded (DTensor) "
                                     "parameters, which --fsdp/--tp make; use --optimizer-impl foreach or auto")
        if self.grad_accum < 1:
            raise ConfigurationError("--grad-accum must be at least 1")
        if self.epochs < 1 and self.max_steps < 1:
            raise ConfigurationError("set --epochs or --max-steps to at least 1")
        p = self.parallel
        if p.pp > 1 and self.grad_accum != 1:
            raise ConfigurationError("with --pp > 1 the pipeline microbatches already accumulate gradients; "
                                     "use --microbatches instead of --grad-accum")
        per_step = p.data_parallel_size * self.grad_accum * (p.microbatches if p.pp > 1 else 1)
        if self.batch_size % per_step:
            raise ConfigurationError(
                f"--batch-size {self.batch_size} (global) must be divisible by data-parallel size "
                f"{p.data_parallel_size} x grad-accum {self.grad_accum}"
                + (f" x microbatches {p.microbatches}" if p.pp > 1 else "")
                + f" = {per_step}; use a multiple of {per_step}")

    def scaled_lr(self) -> float:
        """The learning rate after the batch-size scaling rule (base_batch_size 0 means no scaling)."""
        if self.lr_scaling == "none" or self.base_batch_size <= 0:
            return self.lr
        ratio = self.batch_size / self.base_batch_size
        return self.lr * (ratio if self.lr_scaling == "linear" else ratio ** 0.5)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy (used in summary.json)."""
        return dataclasses.asdict(self)


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def train_config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """Build a TrainConfig from flat keys (parallel keys may be flat or under ``parallel``)."""
    values = {k.replace("-", "_"): v for k, v in values.items()}
    par = dict(values.pop("parallel", {}) or {})
    train_keys, par_keys = _fields(TrainConfig) - {"parallel"}, _fields(ParallelConfig)
    for k in list(values):
        if k in par_keys:
            par[k] = values.pop(k)
    unknown = sorted(set(values) - train_keys) + sorted(set(par) - par_keys)
    if unknown:
        raise ConfigurationError(f"unknown training option(s): {', '.join(unknown)}; "
                                 "run 'fedpar train --help' for the valid ones")
    return TrainConfig(**values, parallel=ParallelConfig(**par))
