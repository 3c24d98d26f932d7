"""Checks run inside ONE spawned 4-rank gloo group (see test_world4.py): 2-D meshes composed by parallelize()."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fedpar.models import build_model
from fedpar.parallel.checkpoint import gather_full_state_dict, gather_pipeline_state_dict
from fedpar.parallel.config import ParallelConfig
from fedpar.parallel.init import init_distributed
from fedpar.parallel.mesh import build_mesh
from fedpar.parallel.parallelize import parallelize

from support.engine_refs import clipped_sgd_step, dense_clipped_sgd_step, full, lm_loss, local_numel, max_abs_diff

STEPS = 3


def _gpt():
    return build_model("gpt", vocab_size=30, block_size=16, n_layer=2, n_head=4, d_model=32)


def _batch(n: int = 8, t: int = 16):
    g = torch.Generator().manual_seed(4)
    data = torch.randint(0, 30, (n, t + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _dense_reference(x, y):
    torch.manual_seed(0)
    ref = _gpt()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = lm_loss(ref(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return ref, losses


def _parallel_gpt(pc: ParallelConfig, activation_checkpointing: bool = False):
    """The GPT parallelized by parallelize() on a mesh for ``pc``, and this rank's data shard of the global batch."""
    info = init_distributed()
    pc = pc.resolved(dist.get_world_size())
    mesh = build_mesh(pc, info.device.type)
    model = parallelize(_gpt, "gpt", pc, mesh, info, lm_loss, seed=0,
                        activation_checkpointing=activation_checkpointing)
    x, y = _batch()
    share = x.shape[0] // pc.data_parallel_size
    lo = mesh.data_parallel_rank * share
    return model, mesh, (x, y), (x[lo:lo + share], y[lo:lo + share])


def _composed(pc: ParallelConfig, activation_checkpointing: bool = False, more=None):
    """Train ``pc``'s parallel GPT and the dense one alike; ``more(model, mesh, dense parameters)``: further
    results."""
    model, mesh, (x, y), (xs, ys) = _parallel_gpt(pc, activation_checkpointing)
    opts = [torch.optim.SGD(p.parameters(), lr=0.1) for p in model.parts]
    losses = []
    for _ in range(STEPS):
        if model.pipeline is not None:
            mb: list[torch.Tensor] = []
            model.pipeline.step(xs, ys, losses=mb)
            loss = torch.stack(mb).detach().mean() if mb else torch.zeros(())
        else:
            loss = lm_loss(model.parts[0](xs), ys)
            loss.backward()
            loss = loss.detach()
        for o in opts:
            o.step()
            o.zero_grad()
        reporter = model.has_last_stage and mesh.coord("tp") == 0
        total = torch.stack([loss * reporter, torch.tensor(float(reporter))])
        dist.all_reduce(total)
        losses.append((total[0] / total[1]).item())
    first_block = next(iter(model.parts[0].layers.values()))
    placements = [str(p) for p in next(first_block.parameters()).placements]
    ref, ref_losses = _dense_reference(x, y)
    ref_params = dict(ref.named_parameters())
    # activation checkpointing wraps blocks; DCP state dicts drop this prefix, named_parameters does not
    params = {k.replace("_checkpoint_wrapped_module.", ""): full(v)
              for part in model.parts for k, v in part.named_parameters()}
    return {"max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "max_param_diff": max_abs_diff(params, ref_params), "n_params_checked": len(params),
            "block_type": type(first_block).__name__, "placements": placements,
            "local_share": sum(local_numel(p) for part in model.parts for p in part.parameters())
            / sum(p.numel() for p in ref.parameters()), **(more(model, mesh, ref_params) if more else {})}


def check_fsdp_x_tp_2x2_matches_dense():
    """TP (with sequence parallel) over "tp", then FSDP2 over "fsdp", on a 2x2 mesh; the whole model gathered to rank
    0 (the final model of `fedpar train`, one mesh dimension at a time) is the dense one's."""
    def gathered(model, mesh, ref_params):
        whole = gather_full_state_dict(model.parts[0])
        if dist.get_rank() != 0:
            return {"gathered": len(whole)}
        return {"gathered": len(whole), "gathered_diff": max_abs_diff(ref_params, whole)}

    return _composed(ParallelConfig(dp=1, fsdp=2, tp=2), more=gathered)


def check_pp_x_fsdp_2x2_matches_dense():
    """Two 1F1B pipeline stages, each sharded by FSDP2 over 2 ranks; the whole model gathered to rank 0 (the final
    model of `fedpar train --pp`) is the dense one's."""
    def gathered(model, mesh, ref_params):
        leader = mesh.coord("fsdp") == 0
        whole = gather_pipeline_state_dict(model.parts, mesh["pp"].get_group(), leader, torch.device("cpu"))
        if dist.get_rank() != 0:
            return {"gathered": len(whole)}
        return {"gathered": len(whole), "gathered_diff": max_abs_diff(ref_params, whole)}

    return _composed(ParallelConfig(dp=1, fsdp=2, pp=2, pp_schedule="1f1b", microbatches=2), more=gathered)


def check_hsdp_with_activation_checkpointing_matches_dense():
    """HSDP (replicate 2 x shard 2) with every block recomputed in backward."""
    return _composed(ParallelConfig(dp=2, fsdp=2), activation_checkpointing=True)


def check_grad_clipping_fsdp_x_tp_2x2():
    """FSDP2 x TP (sequence parallel) on a 2x2 mesh: global grad norm and the clipped SGD step equal the dense's."""
    model, _, (x, y), (xs, ys) = _parallel_gpt(ParallelConfig(dp=1, fsdp=2, tp=2))
    torch.manual_seed(0)
    ref = _gpt()
    dense_norm, max_norm = dense_clipped_sgd_step(ref, x, y, lm_loss)
    lm_loss(model.parts[0](xs), ys).backward()
    params = model.parameters()
    placements = sorted({str(getattr(p.grad, "placements", "plain tensor")) for p in params})
    out = clipped_sgd_step(params, max_norm)
    return {**out, "dense_norm": dense_norm, "max_norm": max_norm, "grad_placements": placements,
            "max_param_diff": max_abs_diff({k: full(v) for k, v in model.parts[0].named_parameters()},
                                           dict(ref.named_parameters()))}
