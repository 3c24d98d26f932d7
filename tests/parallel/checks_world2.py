"""Checks run inside ONE spawned 2-rank gloo group (see test_world2.py); each returns numbers to assert on."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage

from fedpar.models import build_model
from fedpar.parallel.checkpoint import gather_full_state_dict, load_full_state_dict_from_rank0
from fedpar.parallel.config import ConfigurationError, ParallelConfig, TrainConfig
from fedpar.datasets.arrays import CLASSIFICATION, LANGUAGE_MODEL, TrainData
from fedpar.datasets.registry import load_train_data
from fedpar.models.for_data import model_kwargs_for
from fedpar.parallel.ddp import apply_ddp
from fedpar.parallel.init import init_distributed
from fedpar.parallel.fsdp import apply_fsdp
from fedpar.parallel.optim import replicate_partial_grads
from fedpar.parallel.pp import build_pipeline, build_schedule, build_stage_module, stage_ids_for_rank
from fedpar.parallel.sampler import DistributedBatchSampler
from fedpar.parallel.tp import apply_tp
from fedpar.parallel.trainer import Trainer
from fedpar.protocol.tensorfile import load_tensors

from support.engine_refs import TinyMLP, clipped_sgd_step, dense_clipped_sgd_step, full, lm_loss, local_numel, max_abs_diff

STEPS = 4


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _classification_batch(n: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def _token_batch(n: int = 8, t: int = 16, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 32, (n, t + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _train_dense(model, x, y, loss_fn, steps: int = STEPS, opt_cls=torch.optim.SGD, **opt_kw):
    return _train_dense_on(model, [(x, y)] * steps, loss_fn, opt_cls, **opt_kw)


def _train_dense_on(model, batches, loss_fn, opt_cls=torch.optim.SGD, **opt_kw) -> list[float]:
    opt = opt_cls(model.parameters(), **opt_kw)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _params(model):
    return {k: full(v).detach().clone() for k, v in model.named_parameters()}


def check_ddp_equals_single_process():
    """DDP over 2 ranks, each on half the batch, vs one process on the whole batch."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = TinyMLP()
    model = apply_ddp(copy.deepcopy(ref), _mesh())
    x, y = _classification_batch()
    _train_dense(ref, x, y, F.cross_entropy, lr=0.1)
    half = x.shape[0] // 2
    _train_dense(model, x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half], F.cross_entropy, lr=0.1)
    return {"max_param_diff": max_abs_diff(_params(ref), _params(model.module))}


def check_fsdp_memory_and_numerics():
    """FSDP2 + Adam: local share of parameters and optimizer state, and parity with one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = TinyMLP()
    model = apply_fsdp(copy.deepcopy(ref), _mesh())
    x, y = _classification_batch()
    ref_losses = _train_dense(ref, x, y, F.cross_entropy, opt_cls=torch.optim.Adam, lr=1e-2)
    half = x.shape[0] // world
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x[rank * half:(rank + 1) * half]), y[rank * half:(rank + 1) * half]).backward()
        opt.step()
    total = sum(p.numel() for p in ref.parameters())
    local_params = sum(local_numel(p) for p in model.parameters())
    local_state = sum(local_numel(v) for s in opt.state.values() for k, v in s.items() if k != "step")
    return {"param_share": local_params / total, "optim_state_share": local_state / (2 * total),
            "max_param_diff": max_abs_diff(_params(ref), _params(model)), "ref_final_loss": ref_losses[-1]}


def check_tp_mlp_equals_dense():
    """Column-wise then row-wise MLP over 2 ranks vs the dense MLP (same batch on both ranks)."""
    torch.manual_seed(0)
    ref = TinyMLP()
    model = apply_tp(copy.deepcopy(ref), _mesh(), "mlp")
    x, y = _classification_batch()
    ref_losses = _train_dense(ref, x, y, F.cross_entropy, lr=0.1)
    tp_losses = _train_dense(model, x, y, F.cross_entropy, lr=0.1)
    w1 = model[0].weight
    return {"max_loss_diff": max(abs(a - b) for a, b in zip(ref_losses, tp_losses)),
            "max_param_diff": max_abs_diff(_params(ref), _params(model)),
            "w1_local_rows": local_numel(w1) // w1.shape[1], "w1_rows": w1.shape[0]}


def _gpt(n_layers: int = 4):
    return build_model("gpt", vocab_size=32, block_size=16, n_layer=n_layers, n_head=4, d_model=32)


def check_tp_attention_blocks_with_sequence_parallel():
    """The zoo GPT (attention + MLP blocks, rotary positions, RMSNorm) with TP + sequence parallel vs dense."""
    torch.manual_seed(0)
    ref = _gpt()
    model = apply_tp(copy.deepcopy(ref), _mesh(), "gpt", sequence_parallel=True)
    x, y = _token_batch()
    ref_losses = _train_dense(ref, x, y, lm_loss, lr=0.1)
    tp_losses = _train_dense(model, x, y, lm_loss, lr=0.1)
    return {"max_loss_diff": max(abs(a - b) for a, b in zip(ref_losses, tp_losses)),
            "max_param_diff": max_abs_diff(_params(ref), _params(model)),
            "wq_local_share": local_numel(model.layers["0"].attention.wq.weight)
            / model.layers["0"].attention.wq.weight.numel(), "final_loss": tp_losses[-1]}


def _pipeline_vs_unsplit(schedule: str, stages_per_rank: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _gpt(n_layers=4)
    x, y = _token_batch()
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    num_stages = world * stages_per_rank
    ids = stage_ids_for_rank(rank, world, stages_per_rank)
    parts = [build_stage_module(ref, sid, num_stages) for sid in ids]
    for p in parts:
        p.zero_grad(set_to_none=True)
    pipe = build_pipeline(parts, ids, num_stages, torch.device("cpu"), dist.group.WORLD, schedule, 4, lm_loss)
    losses: list[torch.Tensor] = []
    pipe.step(x, y, losses=losses)
    mean_loss = torch.stack(losses).mean() if losses else torch.zeros(())
    dist.all_reduce(mean_loss)  # only the last stage's rank contributes
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    stage_grads = {k: p.grad for part in parts for k, p in part.named_parameters()}
    return {"loss_diff": abs(mean_loss.item() - ref_loss.item()),
            "max_grad_diff": max_abs_diff(stage_grads, ref_grads),
            "params_on_rank": sum(p.numel() for part in parts for p in part.parameters()),
            "params_total": sum(p.numel() for p in ref.parameters())}


def check_pp_gpipe():
    """GPipe, 2 stages, 4 microbatches: loss and gradients equal the unsplit model's."""
    return _pipeline_vs_unsplit("gpipe", 1)


def check_pp_1f1b():
    """1F1B, 2 stages, 4 microbatches."""
    return _pipeline_vs_unsplit("1f1b", 1)


def check_pp_interleaved_1f1b():
    """Interleaved 1F1B, 4 stages on 2 ranks (loop layout)."""
    return _pipeline_vs_unsplit("interleaved1f1b", 2)


def check_full_state_dict_round_trip():
    """gather_full_state_dict on FSDP gives the plain model; loading it from rank 0 restores every shard."""
    torch.manual_seed(0)
    ref = TinyMLP()
    model = apply_fsdp(copy.deepcopy(ref), _mesh())
    gathered = gather_full_state_dict(model)
    gather_diff = max_abs_diff(gathered, ref.state_dict()) if gathered else 0.0
    keys = len(gathered)
    torch.manual_seed(123)
    other = apply_fsdp(TinyMLP(), _mesh())
    before = max_abs_diff(_params(ref), _params(other))
    load_full_state_dict_from_rank0(other, gathered if dist.get_rank() == 0 else {})
    # (loading converts the rank-0 dict's values into DTensors in place, so it was compared above)
    return {"gathered_keys": keys, "gather_diff": gather_diff, "diff_before_load": before,
            "diff_after_load": max_abs_diff(_params(ref), _params(other))}


def check_sampler_uneven_shards():
    """13 examples, 2 ranks, batch 4: both ranks get 2 batches, every example is seen, epochs reshuffle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = DistributedBatchSampler(13, 4, world, rank, seed=7)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append([i for batch in sampler for i in batch])
    counts = torch.tensor([len(list(sampler))], dtype=torch.int64)
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    seen = torch.zeros(13)
    seen[torch.tensor(epochs[0])] = 1
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return {"batches_per_rank": [int(c) for c in gathered], "covered": int(seen.sum()),
            "reshuffled": epochs[0] != epochs[1]}



def _synthetic(n_train: int, n_eval: int, seed: int = 3) -> TrainData:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=g)
    x, ex = torch.randn(n_train, 16, generator=g), torch.randn(n_eval, 16, generator=g)
    return TrainData(x, (x @ w).argmax(1), ex, (ex @ w).argmax(1), CLASSIFICATION)


def _config(out, **kw) -> TrainConfig:
    par = {k: kw.pop(k) for k in [f.name for f in dataclasses.fields(ParallelConfig)] if k in kw}
    base = dict(model="mlp", dataset="synthetic", out=str(out), batch_size=8, epochs=2, lr=0.05,
                optimizer="adamw", log_every=1, warmup_steps=2, grad_clip=1.0, plot=False)
    base.update(kw)
    return TrainConfig(**base, parallel=ParallelConfig(**par))


def _shared_tmp() -> Path:
    path = torch.zeros(1, dtype=torch.int64)
    if dist.get_rank() == 0:
        path[0] = int(time.time() * 1e6) % (10 ** 12)
    dist.broadcast(path, 0)
    return Path(tempfile.gettempdir()) / f"fedpar-resume-{int(path[0])}"


def _train_losses(out: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}


def check_save_kill_resume_continues_identically():
    """FSDP + AdamW + dropout: crash after step 4 (last checkpoint at 3, mid-epoch), resume, compare to no crash."""
    root = _shared_tmp()
    data = _synthetic(40, 13)
    model_fn = lambda: TinyMLP(dropout=0.2)  # noqa: E731
    info = init_distributed()
    straight = Trainer(_config(root / "a", fsdp=2, dp=1, max_steps=7), model_fn, data, info)
    summary_a = straight.run()
    crashed = Trainer(_config(root / "b", fsdp=2, dp=1, max_steps=7, checkpoint_every=3), model_fn, data, info)
    crashed.run(stop_after_steps=4)
    del crashed
    resumed = Trainer(_config(root / "b", fsdp=2, dp=1, max_steps=7, checkpoint_every=3), model_fn, data, info)
    summary_b = resumed.run()
    out = {"resumed_from_step": summary_b["resumed_from_step"], "steps": summary_b["steps"],
           "max_param_diff": max_abs_diff(_params(straight.model.parts[0]), _params(resumed.model.parts[0])),
           "accuracy_a": summary_a["test_accuracy"], "accuracy_b": summary_b["test_accuracy"]}
    if dist.get_rank() == 0:
        la, lb = _train_losses(root / "a"), _train_losses(root / "b")
        out["loss_steps_b"] = sorted(lb)
        out["max_loss_diff"] = max(abs(la[s] - lb[s]) for s in la)
        out["losses_a"] = [la[s] for s in sorted(la)]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def check_uneven_shards_train_without_hanging():
    """13 training and 13 eval examples over 2 DDP ranks: equal step counts, exact distributed accuracy."""
    root = _shared_tmp()
    data = _synthetic(13, 13, seed=5)
    info = init_distributed()
    trainer = Trainer(_config(root, dp=2, batch_size=8, epochs=2, optimizer="sgd"), TinyMLP, data, info)
    summary = trainer.run()
    dense = trainer.model.parts[0].module
    with torch.no_grad():
        dense.eval()
        accuracy = (dense(data.eval_inputs).argmax(1) == data.eval_targets).float().mean().item()
    steps = torch.tensor([summary["steps"]])
    gathered = [torch.zeros_like(steps) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, steps)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"steps_per_rank": [int(t) for t in gathered], "distributed_accuracy": summary["test_accuracy"],
            "dense_accuracy": accuracy}


def check_grad_accumulation_equals_full_batch():
    """DDP trainer: 2 accumulated microbatches per step give the same weights as the whole batch at once."""
    root = _shared_tmp()
    data = _synthetic(32, 8, seed=6)
    info = init_distributed()
    params = []
    for accum in (1, 2):
        cfg = _config(root / str(accum), dp=2, batch_size=16, max_steps=3, grad_accum=accum, optimizer="sgd",
                      log_every=3)
        trainer = Trainer(cfg, TinyMLP, data, info)
        trainer.run()
        params.append(_params(trainer.model.parts[0].module))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"max_param_diff": max_abs_diff(params[0], params[1])}


# ---------------------------------------------------------------------- GPT on a text file, end to end
_WORDS = "the quick brown fox jumps over a lazy dog and then sleeps in warm sun".split()  # 27 symbols: odd vocab


def _text_run(root: Path, **kw) -> tuple[TrainConfig, TrainData, object]:
    """A 2-block GPT config on a tiny UTF-8 file written by rank 0, with the real text loader and model zoo."""
    path = root / "tiny.txt"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        rng = random.Random(0)
        path.write_text(" ".join(rng.choice(_WORDS) for _ in range(1500)), encoding="utf-8")
    dist.barrier()
    base = dict(model="gpt", dataset="text", data_path=str(path), block_size=16, batch_size=8, lr=3e-3,
                warmup_steps=0, grad_clip=1.0, eval_batches=0, log_every=1,
                model_kwargs={"n_layer": 2, "n_head": 2, "d_model": 32})
    base.update(kw)
    cfg = _config(root / "run", **base)
    data, implied = load_train_data("text", str(path), cfg.block_size, cfg.seed)
    kwargs = model_kwargs_for("gpt", implied, cfg.model_kwargs)
    return cfg, data, lambda: build_model("gpt", **kwargs)


def _dense_val_loss(state: dict[str, torch.Tensor], model_fn, data: TrainData) -> float:
    """Mean per-window cross-entropy of the unsplit model over every validation window (no padding)."""
    dense = model_fn()
    dense.load_state_dict(state)
    dense.eval()
    with torch.no_grad():
        logits = dense(data.eval_inputs)
        return F.cross_entropy(logits.flatten(0, 1), data.eval_targets.flatten()).item()


def _summary_file(out: str) -> dict:
    path = Path(out) / "summary.json"
    return json.loads(path.read_text()) if dist.get_rank() == 0 else {}


def check_gpt_text_tensor_parallel():
    """--tp 2 on the GPT over a text file: val_loss falls from the untrained value and equals the dense model's."""
    root = _shared_tmp()
    cfg, data, model_fn = _text_run(root, dp=1, tp=2, max_steps=12)
    info = init_distributed()
    trainer = Trainer(cfg, model_fn, data, info)
    initial = trainer.evaluate()["val_loss"]
    summary = trainer.run()
    state = {k: full(v).detach() for k, v in trainer.model.parts[0].state_dict().items()}
    out = {"initial_val_loss": initial, "val_loss": summary["val_loss"], "precision": summary["precision"],
           "dense_val_loss": _dense_val_loss(state, model_fn, data), "eval_windows": len(data.eval_inputs),
           "vocab": int(data.train_inputs.max()) + 1, "file_val_loss": _summary_file(cfg.out).get("val_loss")}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _stage_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for part in trainer.model.parts for k, v in part.state_dict().items()}


def check_gpt_text_pipeline_checkpoint_resume():
    """--pp 2 (1F1B): crash after step 4 (DCP checkpoint at 3), resume, compare with an uninterrupted run.

    Also checks that val_loss falls and that pipeline evaluation, with a padded last batch, equals the
    unsplit model's exact mean over the validation windows.
    """
    root = _shared_tmp()
    common = dict(dp=1, pp=2, microbatches=2, max_steps=7)
    cfg_a, data, model_fn = _text_run(root / "a", **common)
    cfg_b, _, _ = _text_run(root / "b", checkpoint_every=3, **common)
    info = init_distributed()
    straight = Trainer(cfg_a, model_fn, data, info)
    initial = straight.evaluate()["val_loss"]
    summary_a = straight.run()
    crashed = Trainer(cfg_b, model_fn, data, info)
    crashed.run(stop_after_steps=4)
    ckpt = sorted(p.name for p in (Path(cfg_b.out) / "checkpoints" / "step-00000003").iterdir())
    del crashed
    resumed = Trainer(cfg_b, model_fn, data, info)
    summary_b = resumed.run()
    mine = _stage_params(straight)
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    whole = {k: v for part in gathered for k, v in part.items()}
    out = {"initial_val_loss": initial, "val_loss_a": summary_a["val_loss"], "val_loss_b": summary_b["val_loss"],
           "dense_val_loss": _dense_val_loss(whole, model_fn, data),
           "padded_eval": len(data.eval_inputs) % cfg_a.batch_size != 0,
           "resumed_from_step": summary_b["resumed_from_step"], "steps": summary_b["steps"],
           "max_param_diff": max_abs_diff(mine, _stage_params(resumed)), "checkpoint_files": ckpt,
           "file_val_loss": _summary_file(cfg_b.out).get("val_loss")}
    if dist.get_rank() == 0:
        la, lb = _train_losses(Path(cfg_a.out)), _train_losses(Path(cfg_b.out))
        out["loss_steps_b"] = sorted(lb)
        out["max_loss_diff"] = max(abs(la[s] - lb[s]) for s in la)
        # the final model, gathered from both stages, loads whole into the unwrapped model (strict: no name missing)
        names, arrays, _ = load_tensors(Path(cfg_a.out) / "global.safetensors")
        written = {name: torch.from_numpy(array) for name, array in zip(names, arrays)}
        model_fn().load_state_dict(written)
        out["final_model_diff"] = max_abs_diff(whole, written)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


# ---------------------------------------------------------------------- gradient clipping vs the dense model
def check_grad_clipping_fsdp():
    """FSDP2, each rank on half the batch: global grad norm and the clipped SGD step equal the dense model's."""
    torch.manual_seed(0)
    ref = TinyMLP()
    model = apply_fsdp(copy.deepcopy(ref), _mesh())
    x, y = _classification_batch()
    dense_norm, max_norm = dense_clipped_sgd_step(ref, x, y, F.cross_entropy)
    xl, yl = _local_half(x, y)
    F.cross_entropy(model(xl), yl).backward()
    out = clipped_sgd_step(list(model.parameters()), max_norm)
    return {**out, "dense_norm": dense_norm, "max_norm": max_norm,
            "max_param_diff": max_abs_diff(_params(ref), _params(model))}


def _grad_clipping_tp(ref, family: str, x, y, loss_fn):
    model = apply_tp(copy.deepcopy(ref), _mesh(), family, sequence_parallel=True)
    dense_norm, max_norm = dense_clipped_sgd_step(ref, x, y, loss_fn)
    loss_fn(model(x), y).backward()
    placements = sorted({str(getattr(p.grad, "placements", "plain tensor")) for p in model.parameters()})
    out = clipped_sgd_step(list(model.parameters()), max_norm)
    return {**out, "dense_norm": dense_norm, "max_norm": max_norm, "grad_placements": placements,
            "max_param_diff": max_abs_diff(_params(ref), _params(model))}


def check_grad_clipping_tp_gpt():
    """GPT with TP + sequence parallel (Shard(0), Shard(1), Replicate grads): norm and clipped step vs dense."""
    torch.manual_seed(0)
    return _grad_clipping_tp(_gpt(), "gpt", *_token_batch(), lm_loss)


def check_grad_clipping_tp_mlp():
    """TinyMLP with TP, whose last Linear stays a plain tensor next to the DTensors: norm and clipped step."""
    torch.manual_seed(0)
    return _grad_clipping_tp(TinyMLP(), "mlp", *_classification_batch(), F.cross_entropy)


def check_tp_sequence_parallel_foreach_momentum_sgd_matches_dense():
    """GPT with TP + sequence parallel, momentum SGD with foreach=True (the GPU default): 3 steps vs dense.

    The norm weights' gradients come out Partial(sum); replicate_partial_grads sums them first, as the
    trainer does (torch 2.11's foreach momentum update leaves a Partial DTensor unchanged).
    """
    batches = [_token_batch(seed=s) for s in range(3)]
    ref, ref_losses, _ = _dense_sgd_steps(batches, build=_gpt, loss_fn=lm_loss)
    torch.manual_seed(0)
    model = apply_tp(_gpt(), _mesh(), "gpt", sequence_parallel=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    losses, partial = [], set()
    for x, y in batches:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        partial |= {k for k, p in model.named_parameters()
                    if any(pl.is_partial() for pl in getattr(p.grad, "placements", ()))}
        replicate_partial_grads(list(model.parameters()))
        opt.step()
        losses.append(loss.item())
    return {"partial_grads": sorted(partial), "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "max_param_diff": max_abs_diff(_params(model), _params(ref))}


def check_grad_clipping_pp():
    """GPT in 2 pipeline stages (1F1B): the norm all-reduced over the pp group and the clipped step vs dense."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _gpt(n_layers=4)
    parts = [build_stage_module(ref, rank, world)]
    x, y = _token_batch()
    dense_norm, max_norm = dense_clipped_sgd_step(ref, x, y, lm_loss)
    pipe = build_pipeline(parts, [rank], world, torch.device("cpu"), dist.group.WORLD, "1f1b", 4, lm_loss)
    pipe.step(x, y)
    out = clipped_sgd_step([p for part in parts for p in part.parameters()], max_norm, dist.group.WORLD)
    stage_params = {k: v.detach() for part in parts for k, v in part.named_parameters()}
    return {**out, "dense_norm": dense_norm, "max_norm": max_norm,
            "max_param_diff": max_abs_diff(stage_params, _params(ref))}


# ---------------------------------------------------------------------- trainer steps vs the dense model
def _trainer_for_steps(**kw) -> Trainer:
    """A 2-rank Trainer on TinyMLP for calling train_step directly (nothing is written: run() is not called)."""
    cfg = _config(Path(tempfile.gettempdir()) / "fedpar-unused", optimizer="sgd", lr=0.1, momentum=0.9,
                  warmup_steps=0, grad_clip=0.0, batch_size=16, max_steps=STEPS, **kw)
    return Trainer(cfg, TinyMLP, _synthetic(32, 8), init_distributed())


def _dense_sgd_steps(batches, build=TinyMLP, loss_fn=F.cross_entropy, clip: float | None = None):
    """The model as the trainer builds it (seed 0), momentum SGD (lr 0.1, 0.9) on each whole batch, gradients
    clipped to ``clip`` if given; returns (model, losses, gradient norms before clipping)."""
    torch.manual_seed(0)
    ref = build()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        opt.step()
        losses.append(loss.item())
    return ref, losses, norms


def _local_half(x, y):
    rank, world = dist.get_rank(), dist.get_world_size()
    half = x.shape[0] // world
    return x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]


def _mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def check_fsdp_grad_accumulation_equals_dense_batch():
    """Trainer with --fsdp 2 --grad-accum 2 (reduce-scatter skipped on the first microbatch) vs the dense batch."""
    trainer = _trainer_for_steps(dp=1, fsdp=2, grad_accum=2)
    forward_rows: list[int] = []
    trainer.model.parts[0].register_forward_pre_hook(lambda m, args: forward_rows.append(len(args[0])))
    batches = [_classification_batch(16, seed=10 + s) for s in range(STEPS)]
    ref, ref_losses, _ = _dense_sgd_steps(batches)
    losses = _mean_over_ranks([float(trainer.train_step(*_local_half(x, y))) for x, y in batches])
    model = trainer.model.parts[0]
    return {"max_param_diff": max_abs_diff(_params(ref), _params(model)),
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "forward_rows": forward_rows}


def check_fsdp_bf16_mixed_precision_trains_close_to_fp32_dense():
    """--fsdp 2 --mixed-precision bf16: forward sees bf16 weights, master params and grads stay fp32, near dense."""
    trainer = _trainer_for_steps(dp=1, fsdp=2, mixed_precision="bf16")
    model = trainer.model.parts[0]
    forward_dtypes, grad_dtypes = set(), set()
    model[0].register_forward_pre_hook(lambda m, args: forward_dtypes.add(str(m.weight.dtype)))
    trainer.optimizers[0].register_step_pre_hook(
        lambda opt, args, kwargs: grad_dtypes.update(str(p.grad.dtype) for p in model.parameters()))
    batches = [_classification_batch(16, seed=20)] * STEPS  # one batch again and again: the loss must fall
    ref, ref_losses, _ = _dense_sgd_steps(batches)
    losses = _mean_over_ranks([float(trainer.train_step(*_local_half(x, y))) for x, y in batches])
    return {"precision": trainer.precision, "forward_weight_dtypes": sorted(forward_dtypes),
            "grad_dtypes": sorted(grad_dtypes),
            "master_param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "master_params_sharded": all(hasattr(p, "to_local") for p in model.parameters()),
            "max_param_diff": max_abs_diff(_params(ref), _params(model)),
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)), "losses": losses}


TRAINER_PP_CLIP = 0.3


def check_trainer_interleaved_1f1b_gpt_matches_dense():
    """Trainer.train_step, --pp 2 interleaved1f1b with 2 stages per rank, momentum SGD, clipping: 2 steps vs dense."""
    cfg = _config(Path(tempfile.gettempdir()) / "fedpar-unused", model="gpt", dp=1, pp=2,
                  pp_schedule="interleaved1f1b", stages_per_rank=2, microbatches=4, optimizer="sgd", lr=0.1,
                  momentum=0.9, warmup_steps=0, grad_clip=TRAINER_PP_CLIP, batch_size=8, max_steps=2)
    batches = [_token_batch(8, seed=30 + s) for s in range(2)]
    trainer = Trainer(cfg, _gpt, TrainData(*batches[0], *batches[0], LANGUAGE_MODEL), init_distributed())
    losses = torch.tensor([float(trainer.train_step(x, y)) for x, y in batches], dtype=torch.float64)
    losses *= trainer.reports_loss  # only the last stage's rank has the loss; the sum gives it to both ranks
    dist.all_reduce(losses)
    ref, ref_losses, ref_norms = _dense_sgd_steps(batches, _gpt, lm_loss, TRAINER_PP_CLIP)
    pipeline = trainer.model.pipeline
    stage_params = {k: v.detach() for part in trainer.model.parts for k, v in part.named_parameters()}
    return {"schedule": type(pipeline.schedule).__name__, "stage_ids": [s.stage_index for s in pipeline.stages],
            "num_stages": pipeline.stages[0].num_stages, "max_norm": TRAINER_PP_CLIP, "dense_norms": ref_norms,
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses.tolist(), ref_losses)),
            "max_param_diff": max_abs_diff(stage_params, _params(ref)),
            "params_on_rank": sum(v.numel() for v in stage_params.values()),
            "params_total": sum(p.numel() for p in ref.parameters())}


def check_interleaved_microbatch_rule_matches_torch():
    """For 2..9 microbatches on 2 ranks x 2 stages: our start-up check accepts exactly what torch's schedule does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = stage_ids_for_rank(rank, world, 2)
    stages = [PipelineStage(torch.nn.Linear(2, 2), sid, 2 * world, torch.device("cpu"), group=dist.group.WORLD)
              for sid in ids]
    torch_ok, ours_ok = [], []
    for m in range(2, 10):
        try:
            build_schedule(stages, "interleaved1f1b", m, F.mse_loss)
            torch_ok.append(m)
        except ValueError:
            pass
        try:
            ParallelConfig(dp=1, pp=world, stages_per_rank=2, pp_schedule="interleaved1f1b",
                           microbatches=m).resolved(world)
            ours_ok.append(m)
        except ConfigurationError:
            pass
    return {"torch_accepts": torch_ok, "config_accepts": ours_ok}


# ---------------------------------------------------------------------------- fused AdamW and compile
def _steps_trainer(model: str, model_fn, data: TrainData, **kw) -> Trainer:
    """A 2-rank Trainer (AdamW lr 0.01 unless overridden) for calling train_step directly (run() is not called)."""
    kw = {"optimizer": "adamw", "lr": 0.01, **kw}
    cfg = _config(Path(tempfile.gettempdir()) / "fedpar-unused", model=model, warmup_steps=0, grad_clip=0.0,
                  batch_size=8, max_steps=STEPS, **kw)
    return Trainer(cfg, model_fn, data, init_distributed())


def _dense_adamw_steps(batches, build, loss_fn) -> tuple[torch.nn.Module, list[float]]:
    """The model as the trainer builds it (seed 0), for-loop AdamW (lr 0.01, no decay) on each whole batch."""
    torch.manual_seed(0)
    ref = build()
    return ref, _train_dense_batches(ref, batches, loss_fn)


def _train_dense_batches(model, batches, loss_fn) -> list[float]:
    return _train_dense_on(model, batches, loss_fn, torch.optim.AdamW, lr=0.01, weight_decay=0.0, foreach=False)


def check_fused_adamw_on_tp_and_fsdp_matches_dense():
    """AdamW's default (fused) kernels on TP shards next to a plain layer, and on FSDP shards, vs for-loop dense."""
    batches = [_classification_batch(8, seed=40 + s) for s in range(STEPS)]
    ref, ref_losses = _dense_adamw_steps(batches, TinyMLP, F.cross_entropy)
    out = {}
    for layout, kw in (("tp", dict(dp=1, tp=2)), ("fsdp", dict(dp=1, fsdp=2))):
        trainer = _steps_trainer("mlp", TinyMLP, _synthetic(16, 8), **kw)
        # TP: every rank sees the whole batch; FSDP: each rank its half.
        steps = [float(trainer.train_step(x, y) if layout == "tp" else trainer.train_step(*_local_half(x, y)))
                 for x, y in batches]
        losses = steps if layout == "tp" else _mean_over_ranks(steps)
        opt = trainer.optimizers[0]
        out[layout] = {"fused": opt.defaults["fused"], "groups": len(opt.param_groups),
                       "max_param_diff": max_abs_diff(_params(ref), _params(trainer.model.parts[0])),
                       "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses))}
    return out


def check_compiled_gpt_fsdp_matches_eager():
    """--compile under FSDP2 (blocks compiled in place, then sharded): momentum-SGD steps equal the eager run's.

    SGD, not Adam: Adam's first steps turn the rounding differences of near-zero gradients into whole steps.
    """
    from torch._dynamo.utils import counters

    # The blocks and per-rank batch of test_compile_optim's one-rank run (Inductor's disk cache is shared).
    def gpt():
        return build_model("gpt", vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=32)

    batches = [_token_batch(8, seed=50)] * 3  # one batch again and again: the loss must fall
    data = TrainData(*batches[0], *batches[0], LANGUAGE_MODEL)
    runs = {}
    for compiled in (False, True):
        graphs = counters["stats"]["unique_graphs"]
        trainer = _steps_trainer("gpt", gpt, data, dp=1, fsdp=2, compile=compiled, optimizer="sgd", lr=0.1)
        losses = _mean_over_ranks([float(trainer.train_step(*_local_half(x, y))) for x, y in batches])
        runs[compiled] = (losses, _params(trainer.model.parts[0]), counters["stats"]["unique_graphs"] - graphs)
    return {"max_loss_diff": max(abs(a - b) for a, b in zip(runs[False][0], runs[True][0])),
            "max_param_diff": max_abs_diff(runs[False][1], runs[True][1]),
            "graphs_eager": runs[False][2], "graphs_compiled": runs[True][2], "losses": runs[True][0]}
