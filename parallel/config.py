"""Engine configuration: parallel degrees and training settings as dataclasses, from flat keys or overrides; the
device and launch settings every command that trains shares; and the parallel layout, validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fedpar.datasets.settings import DataSource
from fedpar.sections import Output, Plots, Seeded
from fedpar.settings import NOTED, UNRECORDED, flag_of, redefault, setting

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
LR_SCALING_RULES = ("none", "linear", "sqrt")
MIXED_PRECISION = ("auto", "fp32", "bf16")
OPTIMIZERS = ("sgd", "adamw")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")
PRECISIONS = ("fp32", "bf16")  # of a single-process trainer (client/trainer.py); bf16: forward passes under autocast
DEVICE_HELP = ("auto (the GPUs when present, else the CPU), cpu, cuda (one visible GPU per local rank) or "
               "cuda:N (visible GPU N); CUDA_VISIBLE_DEVICES picks which GPUs are visible")


class ConfigurationError(ValueError):
    """A setting that cannot work, with a message that says what to change."""


@dataclass
class Device:
    """Where a command's models run."""

    device: str = setting("auto", group="device",
                          help=f"where models train and evaluate: {DEVICE_HELP}. simulate and simulate-workers deal "
                               "their worker processes over the GPUs; serve evaluates there", resume=UNRECORDED)


@dataclass
class Precision:
    """The precision one process trains in (the engine's is ParallelConfig.mixed_precision)."""

    precision: str = setting("fp32", choices=PRECISIONS, group="device",
                             help="bf16: forward passes under bf16 autocast, in one process per agent (weights and "
                                  "uploads stay fp32)", resume=NOTED)


@dataclass
class Launch:
    """How many local ranks a command spawns, and how long their collectives may wait."""

    nproc: int = setting(1, check="local_processes", group="parallel",
                         help="local ranks to spawn, one process each (ignored under torchrun, which launches the "
                              "ranks and sets the world size); an agent's rank 0 talks to the coordinator")
    dist_timeout: float = setting(300.0, check="seconds", group="parallel",
                                  help="seconds a collective of the ranks may wait before they give up")


DEFAULT_DP = -1  # --dp-replicate's default: whatever the other degrees leave


def interleaved_microbatches_fit(microbatches: int, pp: int) -> bool:
    """torch's ScheduleInterleaved1F1B rule: microbatches divisible by its rounds, max(1, microbatches // pp)."""
    return microbatches % max(1, microbatches // pp) == 0


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of each parallelism (their product is the world size) and how they are applied.

    ``dp`` replicates (DDP, or the replicate dimension of HSDP when ``fsdp`` > 1), ``fsdp`` shards
    parameters with FSDP2, ``tp`` splits layers with DTensor tensor parallelism, ``pp`` splits the model
    into pipeline stages. One degree may be -1: it is then inferred from the world size.
    """

    dp: int = setting(DEFAULT_DP, flag="dp-replicate", key="dp_replicate", group="parallel",
                      help="DDP replicas (or HSDP's replicate dim with --fsdp; -1: whatever the other degrees leave)")
    fsdp: int = setting(1, group="parallel", help="FSDP2 shards of the model")
    tp: int = setting(1, group="parallel", help="tensor-parallel degree (mlp, gpt)")
    pp: int = setting(1, group="parallel", help="pipeline stages across ranks (gpt)")
    sequence_parallel: bool = setting(True, group="parallel",
                                      help="shard norms/activations along the sequence with --tp")
    mixed_precision: str = setting("auto", choices=MIXED_PRECISION, group="parallel",
                                   help="auto: bf16 params + fp32 reduce on GPU, fp32 on CPU")
    cpu_offload: bool = setting(False, group="parallel", help="keep FSDP shards in CPU memory")
    reshard_after_forward: bool = setting(True, group="parallel", help="free gathered FSDP params after forward")
    pp_schedule: str = setting("1f1b", choices=PIPELINE_SCHEDULES, group="parallel", help="pipeline schedule")
    microbatches: int = setting(4, check="count", group="parallel", help="pipeline microbatches per step")
    stages_per_rank: int = setting(1, check="count", group="parallel",
                                   help="pipeline stages per rank (2+ for interleaved1f1b)")

    def resolved(self, world_size: int, device_type: str = "cpu") -> ParallelLayout:
        """The layout these settings make on ``world_size`` ranks of ``device_type`` ("cpu" or "cuda"): the -1
        degree filled in, every setting checked, and the precision training runs in. Call it once per launch and
        hand the layout to the ranks as it is."""
        degrees = {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp, "pp": self.pp}
        inferred = [k for k, v in degrees.items() if v == -1]
        bad = [f"{flag_of(ParallelConfig, k)} {v}" for k, v in degrees.items() if v == 0 or v < -1]
        if bad:
            raise ConfigurationError(f"parallel degrees must be positive (or -1 to infer one): got {', '.join(bad)}")
        if len(inferred) > 1:
            given, dp = [flag_of(ParallelConfig, k) for k in inferred if k != "dp"], flag_of(ParallelConfig, "dp")
            if "dp" in inferred and self.dp == DEFAULT_DP:  # -1 by default: the user may not have set it at all
                if len(given) == 1:
                    raise ConfigurationError(
                        f"only one degree may be -1 (inferred), but {given[0]} -1 leaves {dp} to infer too: {dp} is "
                        f"-1 by default; set it (e.g. {dp} 1), or give {given[0]} a number")
                raise ConfigurationError(
                    f"only one degree may be -1 (inferred), got {' '.join(f'{g} -1' for g in given)} and {dp} (-1 "
                    f"by default); set {dp} (e.g. {dp} 1) and all but one of {', '.join(given)} to a number")
            raise ConfigurationError(
                f"only one degree may be -1 (inferred), got {', '.join(flag_of(ParallelConfig, k) for k in inferred)}; "
                "set the others")
        known = 1
        for k, v in degrees.items():
            if v != -1:
                known *= v
        if inferred:
            if world_size % known:
                raise ConfigurationError(
                    f"cannot infer {flag_of(ParallelConfig, inferred[0])}: world size {world_size} is not divisible "
                    f"by the product {known} of the other degrees; ask for a multiple of {known} ranks (e.g. --nproc "
                    f"{known}, or torchrun's world size), or choose degrees whose product divides {world_size}")
            degrees[inferred[0]] = world_size // known
        product = degrees["dp"] * degrees["fsdp"] * degrees["tp"] * degrees["pp"]
        if product != world_size:
            raise ConfigurationError(
                f"dp*fsdp*tp*pp = {degrees['dp']}*{degrees['fsdp']}*{degrees['tp']}*{degrees['pp']} = {product} "
                f"but the world size is {world_size}; change the degrees (or --nproc) so they multiply to it")
        settings = dataclasses.replace(self, **degrees)
        settings.check()
        return ParallelLayout(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(ParallelConfig)},
                              world_size=world_size, device_type=device_type,
                              precision=_precision(settings, device_type))

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
            raise ConfigurationError("DDP (--dp-replicate) cannot replicate tensor-parallel (DTensor) parameters; "
                                     "use --fsdp for the data-parallel degree when --tp > 1")

    @property
    def data_parallel_size(self) -> int:
        """How many distinct batches one step consumes (replicas times shards)."""
        return self.dp * self.fsdp

    @property
    def num_stages(self) -> int:
        """Total number of pipeline stages."""
        return self.pp * self.stages_per_rank


BF16, FP32 = "bf16", "fp32"


def bf16_mechanism(config: ParallelConfig, device_type: str) -> str | None:
    """What would apply bf16 to this layout: "fsdp" (FSDP2's MixedPrecisionPolicy), "autocast" (a GPU model that is
    neither FSDP-wrapped nor pipelined), or None (nothing: see parallel/precision.py)."""
    if config.fsdp > 1:
        return "fsdp"
    if device_type == "cuda" and config.pp == 1:
        return "autocast"
    return None


def _precision(config: ParallelConfig, device_type: str) -> str:
    """The precision training runs in ("bf16" or "fp32"); a bf16 request that nothing would apply is an error."""
    mode = config.mixed_precision
    if mode == FP32:
        return FP32
    mechanism = bf16_mechanism(config, device_type)
    if mode == "auto":
        return BF16 if device_type == "cuda" and mechanism else FP32
    if mechanism is None:
        if device_type != "cuda":
            raise ConfigurationError(
                "--mixed-precision bf16 would have no effect here: on CPU only FSDP2 (--fsdp > 1) trains in "
                "bf16, everything else runs in fp32 (the CPU rule); use --mixed-precision fp32 (or auto), or "
                "shard with --fsdp 2 or more")
        raise ConfigurationError(
            "--mixed-precision bf16 would have no effect: pipeline stages (--pp > 1) get bf16 only from FSDP2's "
            "MixedPrecisionPolicy; add --fsdp 2 or more, or use --mixed-precision fp32 (or auto)")
    return BF16


@dataclass(frozen=True)
class ParallelLayout(ParallelConfig):
    """A ParallelConfig validated once (:meth:`ParallelConfig.resolved`) for ``world_size`` ranks on
    ``device_type``: no degree left to infer, and ``precision``, what training really runs in. The launcher makes
    it; every rank gets it as it is (spawn pickles it between our own processes) and resolves nothing again."""

    world_size: int = 1
    device_type: str = "cpu"
    precision: str = FP32

    def check_runs_on(self, world_size: int, device_type: str) -> None:
        """ConfigurationError unless this layout was resolved for ``world_size`` ranks of ``device_type``."""
        if (self.world_size, self.device_type) != (world_size, device_type):
            raise ConfigurationError(
                f"this parallel layout was resolved for {self.world_size} {self.device_type} rank(s), but runs on "
                f"{world_size} {device_type} rank(s); resolve it for the group it runs in")


def layout_for(parallel: ParallelConfig, world_size: int, device_type: str) -> ParallelLayout:
    """``parallel`` as the layout of a group of ``world_size`` ranks of ``device_type``: as it is when the launcher
    resolved it already (checked to fit), else resolved now (the path starts here: a test, or a library user)."""
    if isinstance(parallel, ParallelLayout):
        parallel.check_runs_on(world_size, device_type)
        return parallel
    return parallel.resolved(world_size, device_type)


# Sections are listed last first: a dataclass takes its bases' fields from the last base on.
@dataclass
class TrainConfig(Output, Plots, Seeded, Device, DataSource):
    """Everything the centralized trainer needs: model, data, optimisation and the parallel layout."""

    out: str = redefault(Output, "out", "runs/train")
    data_path: str = setting("", group="data",
                             help="MNIST folder or text file, e.g. ../shared/data/tinyshakespeare/input.txt")
    epochs: int = setting(1, check="count", group="optimisation", help="passes over the training set")
    max_steps: int = setting(0, check="non_negative_int", group="optimisation",
                             help="stop after this many steps (0: epochs)")
    batch_size: int = setting(64, check="count", group="optimisation", help="global batch size per optimizer step")
    lr: float = setting(0.05, check="positive", group="optimisation", help="learning rate at --base-batch-size")
    base_batch_size: int = setting(0, check="non_negative_int", group="optimisation",
                                   help="batch size --lr was tuned for (0: no scaling)")
    lr_scaling: str = setting("none", choices=LR_SCALING_RULES, group="optimisation",
                              help="scale the lr with batch-size/base-batch-size linearly or by its square root")
    warmup_steps: int = setting(0, check="non_negative_int", group="optimisation",
                                help="linear learning-rate warmup steps")
    optimizer: str = setting("sgd", choices=OPTIMIZERS, group="optimisation", help="optimizer")
    optimizer_impl: str = setting("auto", choices=OPTIMIZER_IMPLS, group="optimisation",
                                  help="torch optimizer kernels; auto: fused AdamW (CPU and GPU), torch's default "
                                       "for SGD")
    momentum: float = setting(0.9, check="below_one", group="optimisation", help="SGD momentum")
    weight_decay: float = setting(0.0, check="non_negative", group="optimisation", help="weight decay")
    grad_accum: int = setting(1, check="count", group="optimisation", help="microbatches accumulated per step")
    grad_clip: float = setting(0.0, check="non_negative", group="optimisation",
                               help="max global gradient norm (0: off)")
    activation_checkpointing: bool = setting(False, group="optimisation",
                                             help="recompute block activations in backward")
    compile: bool = setting(False, group="optimisation",
                            help="torch.compile each transformer block (the whole forward of other models)")
    block_size: int = setting(64, check="count", group="data", help="context length for text")
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    eval_batches: int = setting(20, check="non_negative_int", group="outputs",
                                help="validation batches per evaluation for text (0: all)")
    log_every: int = setting(10, check="count", group="outputs", help="steps between progress lines")
    checkpoint_every: int = setting(0, check="non_negative_int", group="outputs",
                                    help="steps between checkpoints (0: none); with --task, one is kept at the end "
                                         "of the first epoch after each such span")
    resume: bool = setting(True, group="outputs", help="continue from OUT/checkpoints/latest if it exists")
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

    def resolved(self, world_size: int, device_type: str) -> TrainConfig:
        """A copy whose parallel settings are the layout of ``world_size`` ranks of ``device_type``, checked with
        the training settings (ConfigurationError saying what to change): once per launch, before any rank
        starts; the ranks get the copy as it is."""
        out = dataclasses.replace(self, parallel=self.parallel.resolved(world_size, device_type))
        out.check()
        return out

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
