"""Tensor (and sequence) parallelism: DTensor ``parallelize_module`` plans for the MLP and the GPT."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fedpar.parallel.config import ConfigurationError
from fedpar.parallel.modules import block_names, transformer_blocks

PlanFn = Callable[[nn.Module], dict]  # a model's tensor-parallel plan: {module name: ParallelStyle}

HEAD_COUNT_NAMES = ("n_heads", "n_head", "n_kv_heads", "num_heads")


def _linear_children(module: nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]


def mlp_plan(model: nn.Module) -> dict[str, object]:
    """Pair consecutive Linear layers as column-wise then row-wise (one all-reduce per pair).

    With an odd number of Linear layers the last one stays replicated.
    """
    names = _linear_children(model)
    if len(names) < 2:
        raise ConfigurationError("tensor parallelism needs at least two Linear layers; use --tp 1 for this model")
    plan: dict[str, object] = {}
    for i in range(0, len(names) - 1, 2):
        plan[names[i]] = ColwiseParallel()
        plan[names[i + 1]] = RowwiseParallel()
    return plan


def _divisors_above_one(*sizes: int) -> list[int]:
    return [d for d in range(2, min(sizes) + 1) if all(n % d == 0 for n in sizes)]


def _check_gpt_divisible(model: nn.Module, tp: int) -> None:
    for name, block in zip(block_names(model), transformer_blocks(model)):
        hidden = block.feed_forward.w1.out_features
        for head_attr in HEAD_COUNT_NAMES:
            heads = getattr(block.attention, head_attr, None)
            if isinstance(heads, int) and heads % tp:
                options = _divisors_above_one(heads, hidden)
                raise ConfigurationError(
                    f"--tp {tp} cannot split the attention heads: block {name} has {head_attr}={heads}, not "
                    f"divisible by {tp}; use a --tp that divides {heads}"
                    + (f" (e.g. {options[0]})" if options else "")
                    + f", or --model-arg n_head=<a multiple of {tp}> (d_model must stay divisible by n_head)")
        if hidden % tp:
            raise ConfigurationError(
                f"--tp {tp} cannot split the feed-forward layer: block {name} is {hidden} wide, not divisible "
                f"by {tp}; use a --tp that divides {hidden}, or --model-arg ffn_hidden=<a multiple of {tp}>")


def _check_mlp_divisible(model: nn.Module, tp: int) -> None:
    modules = dict(model.named_modules())
    for name, style in mlp_plan(model).items():
        width = modules[name].out_features
        if isinstance(style, ColwiseParallel) and width % tp:
            raise ConfigurationError(
                f"--tp {tp} cannot split layer {name}: its {width} outputs are not divisible by {tp}; use a --tp "
                f"that divides {width}, or hidden widths that are multiples of {tp} (--model-arg hidden=[...])")


def check_plan_divisible(model: nn.Module, plan: dict, tp: int) -> None:
    """Raise ConfigurationError when ``plan`` names a module ``model`` lacks, or splits a Linear layer's width
    (outputs column-wise, inputs row-wise) that ``tp`` does not divide (wildcard names are left to torch)."""
    if not isinstance(plan, dict) or not plan:
        raise ConfigurationError(f"the task's tp_plan must return a non-empty dict of module name to parallel "
                                 f"style, got {plan!r}")
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if "*" in name:
            continue
        if name not in modules:
            raise ConfigurationError(f"the task's tp_plan names {name!r}, which its model does not have; its "
                                     f"modules: {', '.join(n for n in modules if n) or 'none'}")
        layer = modules[name]
        if not isinstance(layer, nn.Linear):
            continue
        split = ("outputs", layer.out_features) if isinstance(style, ColwiseParallel) else \
            ("inputs", layer.in_features) if isinstance(style, RowwiseParallel) else None
        if split is not None and split[1] % tp:
            raise ConfigurationError(f"--tp {tp} cannot split layer {name}: its {split[1]} {split[0]} are not "
                                     f"divisible by {tp}; use a --tp that divides {split[1]}")


def check_tp_divisible(model: nn.Module, family: str, tp: int, plan: PlanFn | None = None) -> None:
    """Raise ConfigurationError, saying what to change, when heads or hidden widths do not split ``tp`` ways
    (``plan``: a task's own plan, checked instead of the family's)."""
    if tp <= 1:
        return
    if plan is not None:
        check_plan_divisible(model, plan(model), tp)
    elif family == "gpt":
        _check_gpt_divisible(model, tp)
    elif family == "mlp":
        _check_mlp_divisible(model, tp)
    else:
        raise ConfigurationError(f"tensor parallelism has plans for the mlp and gpt models, not {family!r}; "
                                 "use --tp 1 (and --fsdp/--dp-replicate) for this model")


def _block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, object]:
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, object] = {
        "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if getattr(block.feed_forward, "w3", None) is not None:
        plan["feed_forward.w3"] = ColwiseParallel()
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def _shrink_head_counts(block: nn.Module, tp: int) -> None:
    # After column-wise sharding each rank holds heads/tp heads; models that reshape with a stored
    # head count (rather than -1) must see the local count.
    for head_attr in HEAD_COUNT_NAMES:
        heads = getattr(block.attention, head_attr, None)
        if isinstance(heads, int):
            setattr(block.attention, head_attr, heads // tp)


def apply_tp_gpt(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> nn.Module:
    """Megatron-style TP over ``tp_mesh``: q/k/v and w1 column-wise, wo and w2 row-wise, norms sequence-parallel.

    Works on a whole model or a pipeline stage (``tok_embeddings``/``norm``/``output`` may be None).
    Between blocks activations are sharded along the sequence (dim 1) when ``sequence_parallel``, so the
    model must not add anything whole-sequence-shaped to the embeddings (the zoo GPT uses rotary positions).
    """
    tp = tp_mesh.size()
    check_tp_divisible(model, "gpt", tp)
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    blocks = transformer_blocks(model)
    for block in blocks:
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel))
        _shrink_head_counts(block, tp)
    return model


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, family: str, sequence_parallel: bool = True,
             plan: PlanFn | None = None) -> nn.Module:
    """Apply ``plan`` (a task's own) or else the tensor-parallel plan for a model family (``"gpt"`` or ``"mlp"``)."""
    if plan is not None:
        layout = plan(model)
        check_plan_divisible(model, layout, tp_mesh.size())
        return parallelize_module(model, tp_mesh, layout)
    if family == "gpt":
        return apply_tp_gpt(model, tp_mesh, sequence_parallel)
    if family == "mlp":
        check_tp_divisible(model, "mlp", tp_mesh.size())
        return parallelize_module(model, tp_mesh, mlp_plan(model))
    raise ConfigurationError(f"tensor parallelism has plans for the mlp and gpt models, not {family!r}; "
                             "use --tp 1 (and --fsdp/--dp-replicate) for this model")
