"""Sharded checkpoints with torch.distributed.checkpoint (DCP), resume, and full-state-dict helpers for FL.

A checkpoint directory holds ``step-XXXXXXXX/`` folders written by every rank (each writes its own shards;
rank 0 writes DCP's metadata), each whole as ``step-XXXXXXXX.partial/`` before rank 0 renames it, and a ``latest``
file that rank 0 replaces atomically once all ranks finished.
Items are all tensors (model, optimizer, step counters, per-rank RNG); the only non-tensor entries are the
optimizer's hyper-parameters. DCP plans the files and ``dcp_storage`` writes and reads them: JSON metadata, raw tensor
bytes, JSON hyper-parameters; nothing is pickled.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fedpar.parallel import checkpoint_retention, dcp_storage
from fedpar.parallel.config import TrainConfig
from fedpar.parallel.epoch_checkpoint import is_epoch_checkpoint
from fedpar.parallel.dcp_storage import PlainFileSystemReader, UnsafeCheckpointError, raise_wrapped_stop
from fedpar.parallel.stopping import raise_lost_stop
from fedpar.protocol.run_record import RUN_RECORD, check_settings, read_record, record_settings

LATEST = "latest"
_STEP_NAME = re.compile(r"step-\d{8}")
_STEP_GLOB = "step-" + "?" * 8
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _rng_key() -> str:
    return f"rng.rank{dist.get_rank()}"


def _part_states(model_parts: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer]) -> list[tuple[dict[str, object], dict[str, object]]]:
    return [(get_model_state_dict(part), get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS))
            for part, opt in zip(model_parts, optimizers)]


def _state(parts: list[tuple[dict[str, object], dict[str, object]]], counters: dict[str, int | float]
           ) -> dict[str, object]:
    # Parts of one pipeline rank have disjoint parameter names, so their dicts merge without clashes.
    state: dict[str, object] = {
        "model": {k: v for model_sd, _ in parts for k, v in model_sd.items()},
        "optim": {k: v for _, optim_sd in parts for k, v in optim_sd.items()},
        "counters": {k: torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else torch.int64)
                     for k, v in counters.items()},
        _rng_key(): torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state[_rng_key() + ".cuda"] = torch.cuda.get_rng_state()
    return state


def step_dir(directory: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` optimizer steps."""
    return Path(directory) / f"step-{step:08d}"


def save_checkpoint(directory: str | Path, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                    counters: dict[str, int | float], keep: int = 2, record: dict | None = None) -> Path:
    """Collectively save model, optimizer, ``counters`` (numbers the same on every rank; must include ``step``) and
    every rank's RNG;
    rank 0 keeps ``record`` (what a resume must match: :func:`run_record`) beside them, as run.json.

    Call on all ranks. The checkpoint becomes visible (``latest``) only after every rank has written it; then rank 0
    keeps this run's newest ``keep`` and removes the rest, an earlier run's among them (checkpoint_retention.py).
    """
    directory = Path(directory)
    target = step_dir(directory, counters["step"])
    # Written whole under another name, then renamed: a run started afresh (--no-resume) or resumed from an earlier
    # step writes a step folder again, and the one there may be the only complete checkpoint (the one the `latest`
    # it set aside names, put back if it is stopped before its own is complete)
    staged = target.with_name(target.name + ".partial")
    if dist.get_rank() == 0 and staged.exists():  # a stopped run's (DCP's overwriting is to become a refusal)
        shutil.rmtree(staged)
    dist.barrier()
    try:
        dcp_storage.save(_state(_part_states(model_parts, optimizers), counters), staged)
    except CheckpointException as exc:  # a stop while it writes: `latest` still names the last complete checkpoint
        raise_wrapped_stop(exc)
        raise_lost_stop()  # raised in C code that called back (torch's, gloo's), it came out as that code's error
        raise
    dist.barrier()
    if dist.get_rank() == 0:
        if record is not None:
            record_settings(staged / RUN_RECORD, record)
        checkpoint_retention.put_in_place(staged, target, directory / LATEST)
        checkpoint_retention.prune(directory, target.name, _STEP_GLOB, keep)
    dist.barrier()
    return target


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint named in ``directory/latest``, or None when there is none yet."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if is_epoch_checkpoint(name):  # told to delete `latest`, the task run's user lost its way to resume it
        raise UnsafeCheckpointError(f"{pointer} names {name}, a checkpoint of `fedpar train --task` (a task's "
                                    "epochs), not of the zoo trainer's steps; resume it with that --task, or pass "
                                    "--no-resume to start afresh (or another --out)")
    if not _STEP_NAME.fullmatch(name):
        raise UnsafeCheckpointError(f"{pointer} names {name!r}, not a step-NNNNNNNN folder beside it; "
                                    "delete the file to start afresh or write the folder name into it")
    target = Path(directory) / name
    checkpoint_retention.restore_set_aside(target)
    if not (target / ".metadata").is_file():  # `latest` is written only once every rank wrote the checkpoint
        raise UnsafeCheckpointError(f"{pointer} names {name}, which holds no complete checkpoint (no {name}/.metadata)"
                                    f"; {_instead(target)}")
    return target


def _instead(damaged: Path) -> str:
    """What to do instead of resuming the checkpoint ``damaged``: an older one beside it, or start afresh."""
    older = [p.name for p in sorted(damaged.parent.glob(_STEP_GLOB), reverse=True)
             if p.name < damaged.name and (p / ".metadata").is_file()]
    use = f"write {older[0]} into {damaged.parent / LATEST} to resume the one before it, or " if older else ""
    return f"{use}pass --no-resume to start afresh (or another --out)"


def check_checkpoint(path: Path) -> None:
    """UnsafeCheckpointError, one line saying what to do, when the checkpoint folder ``path`` cannot be resumed: its
    metadata does not read, or a shard file it names is missing or shorter than the metadata says."""
    try:
        metadata = PlainFileSystemReader(str(path)).read_metadata()
    except (UnsafeCheckpointError, OSError) as exc:
        raise UnsafeCheckpointError(f"cannot resume from {path}: {exc}; {_instead(path)}") from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size < end:
            said = "is missing" if size is None else f"has {size} bytes, its metadata says {end}"
            raise UnsafeCheckpointError(f"cannot resume from {path}: its file {name} {said} (the checkpoint is "
                                        f"damaged); {_instead(path)}")


def run_record(config: TrainConfig, data_shape: dict | None = None) -> dict:
    """What a resume of ``config`` (its layout resolved) must match, by the option that sets each: the world size,
    the parallel degrees, the model's settings, the data it was shaped for (``data_shape``: what the data told the
    model, e.g. a text's ``vocab_size``, from another --data-path too), the batch size and seed its data position counts
    in and the optimizer whose state it keeps."""
    p = config.parallel
    record = {"--nproc": getattr(p, "world_size", None), "--dp-replicate": p.dp, "--fsdp": p.fsdp, "--tp": p.tp,
              "--pp": p.pp, "--stages-per-rank": p.stages_per_rank, "--model": config.model,
              "--dataset": config.dataset, "--optimizer": config.optimizer,
              "--model-arg": " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(config.model_kwargs.items())) or "none",
              "--block-size": config.block_size,
              # the epoch's batch it resumes at and the steps of --epochs count batches of this size, in this shuffle
              "--batch-size": config.batch_size, "--seed": config.seed}
    if data_shape is not None:
        record["--data-path"] = " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(data_shape.items())) or "none"
    return record


def check_resume(config: TrainConfig, data_shape: dict | None = None) -> None:
    """A ValueError, one line before any rank starts, when ``config`` would resume (``--resume``, the default) from a
    damaged checkpoint (UnsafeCheckpointError) or one written with another layout, model or data (``data_shape``:
    what this run's data tells the model; RunRecordError): what is wrong, and what to do. A checkpoint of older code
    keeps no record of them: it is resumed as before."""
    latest = latest_checkpoint(Path(config.out) / "checkpoints") if config.resume else None
    if latest is not None:
        check_checkpoint(latest)
        afresh = f"pass --no-resume to start afresh in {config.out} (or another --out)"
        record = run_record(config, data_shape)
        kept = (read_record(latest / RUN_RECORD, afresh) or {}).get("defining")
        if isinstance(kept, dict) and kept.get("--dataset") not in (None, config.dataset):
            record.pop("--data-path", None)  # another dataset's data has another shape: nothing more to say
        check_settings(latest / RUN_RECORD, record, source=str(latest), afresh=afresh)


def load_checkpoint(path: str | Path, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                    counters: dict[str, int | float] | None = None) -> dict[str, int | float]:
    """Collectively restore a checkpoint saved by the same world size into the parts and optimizers.

    Restores this rank's RNG state too, and returns the saved ``counters`` (name: its default, by default just
    ``step``).
    """
    counters = {"step": 0} if counters is None else counters
    parts = _part_states(model_parts, optimizers)
    state = _state(parts, counters)
    try:
        dcp_storage.load(state, path)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"cannot resume from {path}: {exc}; {_instead(Path(path))}") from None
    for part, opt, (model_sd, optim_sd) in zip(model_parts, optimizers, parts):
        set_model_state_dict(part, {k: state["model"][k] for k in model_sd})
        set_optimizer_state_dict(part, opt, {k: state["optim"][k] for k in optim_sd}, options=_OPTIM_OPTIONS)
    torch.set_rng_state(state[_rng_key()])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state[_rng_key() + ".cuda"])
    checkpoint_retention.resumed(Path(path).parent, Path(path).name, _STEP_GLOB)  # this run's checkpoints so far
    return {**counters, **{k: type(counters[k])(v.item()) for k, v in state["counters"].items()}}


def _whole(value):
    """``value`` whole on this rank as a plain tensor: a DTensor gathered over its mesh one dimension at a time, the
    outermost first (FSDP shards the tensor-parallel shard, so its gather comes first); anything else as it is.

    DTensor's own gather of an FSDP x TP parameter ((_StridedShard, Shard) to (Replicate, Replicate)) is two
    all-gathers too, but it warns on every rank that they cannot be merged into one."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(value, DTensor):
        return value
    if value.device.type != value.device_mesh.device_type:  # FSDP's CPU offload: gathered on the mesh's device
        value = value.to(value.device_mesh.device_type)
    placements = list(value.placements)
    for dim in range(len(placements)):
        if not placements[dim].is_replicate():
            placements[dim] = Replicate()
            value = value.redistribute(value.device_mesh, placements)
    local = value.to_local()
    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0 receives the whole unsharded model as plain CPU tensors; the other ranks get ``{}``.

    For a sharded (FSDP/TP/DDP) model whose parameters all live on this process group; call on all ranks.
    """
    keep = not dist.is_initialized() or dist.get_rank() == 0
    whole = {}
    for name, value in get_model_state_dict(model).items():
        value = _whole(value)  # every rank takes part in each gather
        if keep:
            whole[name] = value.cpu() if isinstance(value, torch.Tensor) else value
    return whole


def gather_pipeline_state_dict(parts: list[nn.Module], pp_group: dist.ProcessGroup, stage_leader: bool,
                               device: torch.device) -> dict[str, torch.Tensor]:
    """Rank 0 receives the whole model of a pipeline as plain CPU float32 tensors, by the unwrapped model's names;
    the other ranks get ``{}``. Call on all ranks.

    Each rank gathers its stages whole over their data- and tensor-parallel ranks; the stage leaders (data- and
    tensor-parallel coordinates 0: ``pp_group`` is then the pipeline group of rank 0) send theirs to rank 0, each as
    a JSON list of names and shapes, then one flat tensor (sends of tensors: no pickle). Only floating tensors are
    kept, as the final model keeps them.
    """
    # Every rank gathers its stages: a later stage's ranks hold none of rank 0's names.
    mine = {k: _whole(v).detach() for part in parts for k, v in get_model_state_dict(part).items()
            if torch.is_floating_point(v)}
    if not stage_leader:
        return {}
    pp_rank, pp = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    if pp_rank > 0:
        header = torch.tensor(list(json.dumps([[k, list(v.shape)] for k, v in mine.items()]).encode()),
                              dtype=torch.uint8, device=device)
        flat = torch.cat([v.to(device, torch.float32).reshape(-1) for v in mine.values()]) if mine else \
            torch.zeros(0, device=device)
        dst = dist.get_global_rank(pp_group, 0)
        for tensor in (torch.tensor([header.numel(), flat.numel()], dtype=torch.int64, device=device), header, flat):
            dist.send(tensor, dst=dst, group=pp_group)
        return {}
    whole = {k: v.to("cpu", torch.float32) for k, v in mine.items()}
    for r in range(1, pp):
        src = dist.get_global_rank(pp_group, r)
        sizes = torch.zeros(2, dtype=torch.int64, device=device)
        dist.recv(sizes, src=src, group=pp_group)
        header = torch.zeros(int(sizes[0]), dtype=torch.uint8, device=device)
        flat = torch.zeros(int(sizes[1]), dtype=torch.float32, device=device)
        dist.recv(header, src=src, group=pp_group)
        dist.recv(flat, src=src, group=pp_group)
        offset, flat = 0, flat.cpu()
        for name, shape in json.loads(bytes(header.cpu().tolist()).decode()):
            count = math.prod(shape)
            whole[name] = flat[offset:offset + count].reshape(shape).clone()
            offset += count
    return whole


def load_full_state_dict_from_rank0(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a full state dict held by rank 0 (other ranks pass ``{}``) into a sharded model on all ranks."""
    set_model_state_dict(model, state_dict,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
