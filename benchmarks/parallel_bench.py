"""Parallel engine benchmark: DDP scaling, per-rank memory (DDP / FSDP / TP), measured pipeline bubble.

    .venv/bin/python benchmarks/parallel_bench.py [--quick]

Two launches (1 rank, then 2 ranks; gloo on CPU, NCCL if CUDA is available; one thread per rank):
- DDP: global samples/s of an MLP at a fixed per-rank batch (weak scaling); efficiency = sps(2) / (2 sps(1)).
- Memory: a GPT trained 2 steps with AdamW under DDP, FSDP and TP on 2 ranks vs one process. "state" is
  the parameters + gradients + optimizer state held by the rank (local shards); "peak" is the rise of the
  process's peak RSS (VmHWM, reset through /proc/self/clear_refs before each layout) or, on GPU,
  torch.cuda.max_memory_allocated.
- Pipeline: GPipe over 2 stages with m microbatches. Bubble = 1 - busy / step time, where busy is the time
  the same stage needs for m microbatch forwards+backwards run alone; compared with (p-1)/(m+p-1).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from fedpar.models import build_model
from fedpar.parallel.ddp import apply_ddp
from fedpar.parallel.fsdp import apply_fsdp
from fedpar.parallel.init import device_type
from fedpar.parallel.metrics import model_state_bytes
from fedpar.parallel.pp import build_pipeline, build_stage_module
from fedpar.parallel.testing import lm_loss, run_checks
from fedpar.parallel.tp import apply_tp

QUICK = os.environ.get("FEDPAR_BENCH_QUICK") == "1"
DDP_BATCH, DDP_STEPS, DDP_REPEATS = 128, 10, (3 if QUICK else 6)
MEM_GPT = dict(vocab_size=65, block_size=64, n_layer=6, n_head=6, d_model=384)
PIPE_GPT = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, d_model=128)
PIPE_BATCH, PIPE_MICROBATCHES, PIPE_REPEATS = 64, (1, 2, 4, 8), (3 if QUICK else 6)


def _device() -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device_type() == "cuda" \
        else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_ddp_throughput() -> dict:
    """Global samples/s of an MLP (784-1024-1024-10, SGD), plain with 1 rank, DDP with more."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), _device()
    torch.manual_seed(0)
    model = build_model("mlp", in_features=784, hidden=(1024, 1024), num_classes=10).to(dev)
    if world > 1:
        model = apply_ddp(model, init_device_mesh(device_type(), (world,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(DDP_BATCH, 784, generator=g).to(dev), torch.randint(0, 10, (DDP_BATCH,), generator=g).to(dev)

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    steps(3)
    allreduce = 0.0
    if world > 1:  # what one step's gradient all-reduce costs on this backend, for context
        grads = torch.zeros(sum(p.numel() for p in model.parameters()), device=dev)
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(grads)
            _sync()
            times.append(time.perf_counter() - t0)
        allreduce = min(times)
    rates = []
    for _ in range(DDP_REPEATS):
        dist.barrier()
        _sync()
        t0 = time.perf_counter()
        steps(DDP_STEPS)
        _sync()
        rates.append(world * DDP_BATCH * DDP_STEPS / (time.perf_counter() - t0))
    return {"samples_per_second": max(rates), "samples_per_second_median": statistics.median(rates),
            "step_seconds": world * DDP_BATCH / max(rates), "allreduce_seconds": allreduce,
            "gradient_bytes": 4 * sum(p.numel() for p in model.parameters())}


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS, so the next layout's peak starts from what is really in use."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the peak rise may then be understated for later layouts
        pass


def _reset_peak() -> int:
    """Reset the peak-memory counter; returns the current usage it is measured against."""
    _release_freed_memory()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")
    return _proc_status("VmRSS")


def _proc_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _proc_status("VmHWM")


def _memory_of(layout: str) -> dict:
    world, dev = dist.get_world_size(), _device()
    base = _reset_peak()
    torch.manual_seed(0)
    model = build_model("gpt", **MEM_GPT).to(dev)
    if layout == "ddp":
        model = apply_ddp(model, init_device_mesh(device_type(), (world,)))
    elif layout == "fsdp":
        model = apply_fsdp(model, init_device_mesh(device_type(), (world,)))
    elif layout == "tp":
        model = apply_tp(model, init_device_mesh(device_type(), (world,)), "gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 65, (4, 64), generator=g).to(dev)
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        lm_loss(model(x), x).backward()
        opt.step()
    result = {"state_bytes": model_state_bytes([model], [opt]), "peak_rise_bytes": _peak() - base}
    del model, opt
    gc.collect()
    return result


def bench_memory() -> dict:
    """Per-rank state bytes and peak-memory rise for each layout available at this world size."""
    layouts = ["single"] if dist.get_world_size() == 1 else ["fsdp", "tp", "ddp"]
    return {layout: _memory_of(layout) for layout in layouts}


def _stage_busy_seconds(stage_mod: torch.nn.Module, stage_index: int, m: int, dev: torch.device) -> float:
    """Time for this stage alone to run m microbatch forwards and backwards (no communication)."""
    mb = PIPE_BATCH // m
    t, d = PIPE_GPT["block_size"], PIPE_GPT["d_model"]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 65, (mb, t), generator=g).to(dev)
    hidden = torch.randn(mb, t, d, generator=g).to(dev)

    def once() -> None:
        inp = tokens if stage_index == 0 else hidden.clone().requires_grad_(True)
        out = stage_mod(inp)
        if stage_mod.output is not None:
            lm_loss(out, tokens).backward()
        else:
            out.backward(torch.ones_like(out))

    once()
    best = float("inf")
    for _ in range(PIPE_REPEATS):
        _sync()
        t0 = time.perf_counter()
        for _ in range(m):
            once()
        _sync()
        best = min(best, time.perf_counter() - t0)
    stage_mod.zero_grad(set_to_none=True)
    return best


def bench_pipeline_bubble() -> dict:
    """GPipe over all ranks (one stage each): measured bubble for several microbatch counts."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), _device()
    torch.manual_seed(0)
    full = build_model("gpt", **PIPE_GPT).to(dev)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 65, (PIPE_BATCH, PIPE_GPT["block_size"]), generator=g).to(dev)
    out = {}
    for m in PIPE_MICROBATCHES:
        stage_mod = build_stage_module(full, rank, world)
        busy = _stage_busy_seconds(stage_mod, rank, m, dev)
        pipe = build_pipeline([stage_mod], [rank], world, dev, dist.group.WORLD, "gpipe", m, lm_loss)
        first, last = pipe.has_first_stage, pipe.has_last_stage

        def step() -> None:
            pipe.schedule.step(x if first else None, target=x if last else None)
            stage_mod.zero_grad(set_to_none=True)

        step()
        best = float("inf")
        for _ in range(PIPE_REPEATS):
            dist.barrier()
            _sync()
            t0 = time.perf_counter()
            step()
            _sync()
            best = min(best, time.perf_counter() - t0)
        out[str(m)] = {"busy_seconds": busy, "step_seconds": best, "bubble": max(0.0, 1.0 - busy / best),
                       "theory": (world - 1) / (m + world - 1)}
        del pipe, stage_mod
    return out


def _fmt_mb(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def _print_tables(single: dict, pair: list[dict]) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    print(f"\nfedpar parallel engine benchmark ({backend}, {device_type()}, 1 thread per rank, "
          f"{os.cpu_count()} cores)\n")
    s1 = single["bench_ddp_throughput"]["samples_per_second"]
    s2 = pair[0]["bench_ddp_throughput"]["samples_per_second"]
    print(f"DDP weak scaling (MLP 784-1024-1024-10, per-rank batch {DDP_BATCH}; best of {DDP_REPEATS} runs "
          f"of {DDP_STEPS} steps)")
    d1, d2 = single["bench_ddp_throughput"], pair[0]["bench_ddp_throughput"]
    print(f"{'ranks':>5} | {'samples/s':>10} | {'speed-up':>8} | {'efficiency':>10} | {'step s':>7} | "
          f"{'all-reduce s':>12}")
    print(f"{1:>5} | {s1:>10.0f} | {1.0:>8.2f} | {1.0:>10.2f} | {d1['step_seconds']:>7.3f} | {'-':>12}")
    print(f"{2:>5} | {s2:>10.0f} | {s2 / s1:>8.2f} | {s2 / (2 * s1):>10.2f} | {d2['step_seconds']:>7.3f} | "
          f"{d2['allreduce_seconds']:>12.3f}")
    print(f"(all-reduce s: one plain all_reduce of the {d2['gradient_bytes'] / 2**20:.1f} MiB gradient, "
          "best of 5)\n")
    print(f"Per-rank memory, GPT {MEM_GPT['n_layer']}x{MEM_GPT['d_model']} + AdamW "
          f"(MiB; state = params+grads+optimizer state held; peak = rise of peak "
          f"{'CUDA allocation' if torch.cuda.is_available() else 'RSS (VmHWM)'})")
    base = single["bench_memory"]["single"]
    print(f"{'layout':>8} | {'ranks':>5} | {'state rank0':>11} | {'state rank1':>11} | {'vs single':>9} | "
          f"{'peak rank0':>10} | {'peak rank1':>10}")
    print(f"{'single':>8} | {1:>5} | {_fmt_mb(base['state_bytes']):>11} | {'-':>11} | {1.0:>9.2f} | "
          f"{_fmt_mb(base['peak_rise_bytes']):>10} | {'-':>10}")
    for layout in ("ddp", "fsdp", "tp"):
        r0, r1 = pair[0]["bench_memory"][layout], pair[1]["bench_memory"][layout]
        print(f"{layout:>8} | {2:>5} | {_fmt_mb(r0['state_bytes']):>11} | {_fmt_mb(r1['state_bytes']):>11} | "
              f"{r0['state_bytes'] / base['state_bytes']:>9.2f} | {_fmt_mb(r0['peak_rise_bytes']):>10} | "
              f"{_fmt_mb(r1['peak_rise_bytes']):>10}")
    print(f"\nPipeline bubble, GPipe, p=2 stages, GPT {PIPE_GPT['n_layer']}x{PIPE_GPT['d_model']}, "
          f"global batch {PIPE_BATCH}; best of {PIPE_REPEATS}; mean of the two ranks)")
    print(f"{'m':>3} | {'step s':>8} | {'busy s':>8} | {'measured bubble':>15} | {'(p-1)/(m+p-1)':>13}")
    for m in PIPE_MICROBATCHES:
        rs = [r["bench_pipeline_bubble"][str(m)] for r in pair]
        step = statistics.mean(r["step_seconds"] for r in rs)
        busy = statistics.mean(r["busy_seconds"] for r in rs)
        bubble = statistics.mean(r["bubble"] for r in rs)
        print(f"{m:>3} | {step:>8.3f} | {busy:>8.3f} | {bubble:>15.2f} | {rs[0]['theory']:>13.2f}")


def _check(results: list[dict], names: list[str]) -> None:
    for rank, res in enumerate(results):
        for name in names:
            if name not in res or "error" in res[name]:
                sys.exit(f"{name} failed on rank {rank}:\n{res.get(name, {}).get('error', 'did not run')}")


def main() -> int:
    """Run both launches and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed repetitions")
    args = parser.parse_args()
    if args.quick:
        os.environ["FEDPAR_BENCH_QUICK"] = "1"
    here = Path(__file__).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        names1 = ["bench_ddp_throughput", "bench_memory"]
        single = run_checks(1, here, names1, Path(tmp) / "w1")
        _check(single, names1)
        names2 = ["bench_ddp_throughput", "bench_memory", "bench_pipeline_bubble"]
        pair = run_checks(2, here, names2, Path(tmp) / "w2")
        _check(pair, names2)
    _print_tables(single[0], pair)
    print(f"\n(total {time.perf_counter() - t0:.0f} s including process start-up)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
