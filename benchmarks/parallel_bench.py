"""Parallel engine benchmark: DDP scaling, per-rank memory (DDP / FSDP / TP), measured pipeline bubble.

    .venv/bin/python benchmarks/parallel_bench.py [--quick] [--ranks 1 2 4]

One launch per world size (gloo on CPU, NCCL if CUDA is available; one thread per rank):
- DDP: global samples/s of an MLP at a fixed per-rank batch (weak scaling) for each world size in --ranks
  (default 1 2 on CPU; 1 2 4 ... up to the GPU count on CUDA; 1 is always run as the baseline);
  efficiency(n) = sps(n) / (n sps(1)). Rows with more ranks than CPU cores are marked oversubscribed.
- Memory: a GPT trained 2 steps with AdamW under DDP, FSDP and TP on 2 ranks vs one process. "state" is
  the parameters + gradients + optimizer state held by the rank (local shards); "peak" is the rise of the
  process's peak RSS (VmHWM, reset through /proc/self/clear_refs before each layout) or, on GPU,
  torch.cuda.max_memory_allocated.
- Pipeline: torch's ScheduleGPipe and Schedule1F1B over 2 stages with m microbatches. Bubble = 1 - busy /
  step time, where busy is the time the same stage needs for m microbatch forwards+backwards run alone
  (timed in turn with the two schedules, so outside load hits all three alike); both schedules are
  compared with (p-1)/(m+p-1). Schedule1F1B refuses m < p (torch raises ValueError): those cells stay empty.
"""

from __future__ import annotations

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

from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.models import build_model
from fedpar.parallel.ddp import apply_ddp
from fedpar.parallel.fsdp import apply_fsdp
from fedpar.parallel.init import init_distributed
from fedpar.parallel.metrics import model_state_bytes
from fedpar.parallel.pp import build_pipeline, build_stage_module
from fedpar.parallel.tp import apply_tp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support; spawned ranks inherit it
from support.engine_refs import lm_loss  # noqa: E402
from support.spawn_checks import run_checks  # noqa: E402

from results import write_results  # noqa: E402  (benchmarks/, this script's folder)

QUICK = os.environ.get("FEDPAR_BENCH_QUICK") == "1"
DDP_BATCH, DDP_STEPS, DDP_REPEATS = 128, 10, (3 if QUICK else 6)
MEM_GPT = dict(vocab_size=65, block_size=64, n_layer=6, n_head=6, d_model=384)
PIPE_GPT = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, d_model=128)
PIPE_BATCH, PIPE_MICROBATCHES, PIPE_REPEATS = 64, (1, 2, 4, 8), (3 if QUICK else 6)
PIPE_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B"}  # build_schedule names -> torch schedule labels


def _device() -> torch.device:
    return init_distributed().device  # the group run_checks joined: this rank's GPU, or the CPU


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_ddp_throughput() -> dict:
    """Global samples/s of an MLP (784-1024-1024-10, SGD), plain with 1 rank, DDP with more."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), _device()
    torch.manual_seed(0)
    model = build_model("mlp", in_features=784, hidden=(1024, 1024), num_classes=10).to(dev)
    if world > 1:
        model = apply_ddp(model, init_device_mesh(dev.type, (world,)))
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
            "repeats": DDP_REPEATS,
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
        model = apply_ddp(model, init_device_mesh(dev.type, (world,)))
    elif layout == "fsdp":
        model = apply_fsdp(model, init_device_mesh(dev.type, (world,)))
    elif layout == "tp":
        model = apply_tp(model, init_device_mesh(dev.type, (world,)), "gpt")
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


def _stage_alone(stage_mod: torch.nn.Module, stage_index: int, m: int, dev: torch.device):
    """A callable that runs this stage alone over m microbatch forwards and backwards (no communication)."""
    mb = PIPE_BATCH // m
    t, d = PIPE_GPT["block_size"], PIPE_GPT["d_model"]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 65, (mb, t), generator=g).to(dev)
    hidden = torch.randn(mb, t, d, generator=g).to(dev)

    def run() -> None:
        for _ in range(m):
            inp = tokens if stage_index == 0 else hidden.clone().requires_grad_(True)
            out = stage_mod(inp)
            if stage_mod.output is not None:
                lm_loss(out, tokens).backward()
            else:
                out.backward(torch.ones_like(out))
        stage_mod.zero_grad(set_to_none=True)

    return run


def bench_pipeline_bubble() -> dict:
    """GPipe and 1F1B over all ranks (one stage each): measured bubble for several microbatch counts.

    In every repetition the stage alone (busy), the GPipe step and the 1F1B step are timed one after the
    other, each on its own copy of the stage, so load from other work on the machine affects all three alike.
    Returns {schedule: {m: figures}}; where torch refuses a schedule (1F1B with m < p) the entry is
    {"skipped": torch's message}.
    """
    world, rank, dev = dist.get_world_size(), dist.get_rank(), _device()
    torch.manual_seed(0)
    full = build_model("gpt", **PIPE_GPT).to(dev)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 65, (PIPE_BATCH, PIPE_GPT["block_size"]), generator=g).to(dev)
    out: dict[str, dict] = {name: {} for name in PIPE_SCHEDULES}
    for m in PIPE_MICROBATCHES:
        runs = {"busy": _stage_alone(build_stage_module(full, rank, world), rank, m, dev)}
        for name in PIPE_SCHEDULES:
            stage_mod = build_stage_module(full, rank, world)
            try:
                pipe = build_pipeline([stage_mod], [rank], world, dev, dist.group.WORLD, name, m, lm_loss)
            except ValueError as exc:  # torch's own rule (Schedule1F1B: m >= number of stages)
                out[name][str(m)] = {"skipped": " ".join(str(exc).split())}
                continue

            def step(pipe=pipe) -> None:
                pipe.step(x, x)
                pipe.modules[0].zero_grad(set_to_none=True)

            runs[name] = step
        for run in runs.values():  # warm-up (pipeline shape inference, allocator)
            run()
        best = {name: float("inf") for name in runs}
        for _ in range(PIPE_REPEATS):
            for name, run in runs.items():
                dist.barrier()
                _sync()
                t0 = time.perf_counter()
                run()
                _sync()
                best[name] = min(best[name], time.perf_counter() - t0)
        busy = best.pop("busy")
        for name, step_seconds in best.items():
            out[name][str(m)] = {"busy_seconds": busy, "step_seconds": step_seconds,
                                 "bubble": max(0.0, 1.0 - busy / step_seconds),
                                 "theory": (world - 1) / (m + world - 1), "repeats": PIPE_REPEATS}
        del runs
    return out


def _fmt_mb(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def _print_tables(runs: dict[int, list[dict]], ranks: list[int]) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    cores = os.cpu_count() or 1
    print(f"\nfedpar parallel engine benchmark ({backend}, {'cuda' if backend == 'nccl' else 'cpu'}, 1 thread per rank, "
          f"{cores} cores" + (f", {torch.cuda.device_count()} GPUs" if torch.cuda.is_available() else "") + ")\n")
    print(f"DDP weak scaling (MLP 784-1024-1024-10, per-rank batch {DDP_BATCH}; best of "
          f"{runs[1][0]['bench_ddp_throughput']['repeats']} runs "
          f"of {DDP_STEPS} steps; efficiency = sps(n) / (n sps(1)))")
    print(f"{'ranks':>5} | {'samples/s':>10} | {'speed-up':>8} | {'efficiency':>10} | {'step s':>7} | "
          f"{'all-reduce s':>12}")
    s1 = runs[1][0]["bench_ddp_throughput"]["samples_per_second"]
    oversubscribed = []
    for n in ranks:
        d = runs[n][0]["bench_ddp_throughput"]
        sps = d["samples_per_second"]
        allreduce = f"{d['allreduce_seconds']:>12.3f}" if n > 1 else f"{'-':>12}"
        over = not torch.cuda.is_available() and n > cores
        if over:
            oversubscribed.append(n)
        print(f"{n:>5} | {sps:>10.0f} | {sps / s1:>8.2f} | {sps / (n * s1):>10.2f} | {d['step_seconds']:>7.3f} | "
              f"{allreduce}" + ("  oversubscribed" if over else ""))
    multi = [n for n in ranks if n > 1]
    if multi:
        grad = runs[multi[0]][0]["bench_ddp_throughput"]["gradient_bytes"]
        print(f"(all-reduce s: one plain all_reduce of the {grad / 2**20:.1f} MiB gradient, best of 5)")
    if oversubscribed:
        print(f"(oversubscribed: {', '.join(map(str, oversubscribed))} ranks on {cores} cores; the ranks "
              f"time-share the cores, so efficiency is at most about {cores}/n)")
    print()
    if 2 not in runs:
        print("(per-rank memory and pipeline bubble need 2 ranks: skipped, fewer than 2 GPUs)")
        return
    pair = runs[2]
    print(f"Per-rank memory, GPT {MEM_GPT['n_layer']}x{MEM_GPT['d_model']} + AdamW "
          f"(MiB; state = params+grads+optimizer state held; peak = rise of peak "
          f"{'CUDA allocation' if torch.cuda.is_available() else 'RSS (VmHWM)'})")
    base = runs[1][0]["bench_memory"]["single"]
    print(f"{'layout':>8} | {'ranks':>5} | {'state rank0':>11} | {'state rank1':>11} | {'vs single':>9} | "
          f"{'peak rank0':>10} | {'peak rank1':>10}")
    print(f"{'single':>8} | {1:>5} | {_fmt_mb(base['state_bytes']):>11} | {'-':>11} | {1.0:>9.2f} | "
          f"{_fmt_mb(base['peak_rise_bytes']):>10} | {'-':>10}")
    for layout in ("ddp", "fsdp", "tp"):
        r0, r1 = pair[0]["bench_memory"][layout], pair[1]["bench_memory"][layout]
        print(f"{layout:>8} | {2:>5} | {_fmt_mb(r0['state_bytes']):>11} | {_fmt_mb(r1['state_bytes']):>11} | "
              f"{r0['state_bytes'] / base['state_bytes']:>9.2f} | {_fmt_mb(r0['peak_rise_bytes']):>10} | "
              f"{_fmt_mb(r1['peak_rise_bytes']):>10}")
    print(f"\nPipeline bubble, p=2 stages, GPT {PIPE_GPT['n_layer']}x{PIPE_GPT['d_model']}, global batch "
          f"{PIPE_BATCH} (stage alone, ScheduleGPipe and Schedule1F1B timed in turn; best of "
          f"{pair[0]['bench_pipeline_bubble']['gpipe'][str(PIPE_MICROBATCHES[0])]['repeats']}; "
          "mean of the two ranks)")
    header = f"{'m':>3} | {'busy s':>8}"
    for label in PIPE_SCHEDULES.values():
        header += f" | {label + ' step s':>12} | {label + ' bubble':>12}"
    print(header + f" | {'(p-1)/(m+p-1)':>13}")
    skipped = {}
    for m in PIPE_MICROBATCHES:
        busy, theory, row = None, None, ""
        for name in PIPE_SCHEDULES:
            rs = [r["bench_pipeline_bubble"][name][str(m)] for r in pair]
            if "skipped" in rs[0]:
                skipped.setdefault(rs[0]["skipped"], []).append((PIPE_SCHEDULES[name], m))
                row += f" | {'-':>12} | {'-':>12}"
                continue
            busy = statistics.mean(r["busy_seconds"] for r in rs)
            theory = rs[0]["theory"]
            row += (f" | {statistics.mean(r['step_seconds'] for r in rs):>12.3f} | "
                    f"{statistics.mean(r['bubble'] for r in rs):>12.2f}")
        print(f"{m:>3} | {busy:>8.3f}{row} | {theory:>13.2f}")
    for message, cells in skipped.items():
        print(f"(- : {', '.join(f'{label} at m={m}' for label, m in cells)} not run; torch: {message})")


def _ratios(runs: dict[int, list[dict]], ranks: list[int]) -> list[dict]:
    """The tables' same-run ratios for the results envelope: DDP efficiency, per-rank state, pipeline bubble."""
    s1 = runs[1][0]["bench_ddp_throughput"]["samples_per_second"]
    cores = os.cpu_count() or 1
    ratios = [{"what": f"DDP weak scaling efficiency, {n} ranks"
               + (" (oversubscribed)" if not torch.cuda.is_available() and n > cores else ""),
               "ratio": runs[n][0]["bench_ddp_throughput"]["samples_per_second"] / (n * s1),
               "against": f"{n} x one rank's samples/s, same run"} for n in ranks if n > 1]
    if 2 not in runs:
        return ratios
    pair, base = runs[2], runs[1][0]["bench_memory"]["single"]
    gpt = f"GPT {MEM_GPT['n_layer']}x{MEM_GPT['d_model']} + AdamW"
    ratios += [{"what": f"per-rank state, {layout.upper()} on 2 ranks, {gpt}",
                "ratio": pair[0]["bench_memory"][layout]["state_bytes"] / base["state_bytes"],
                "against": "one process, same run"} for layout in ("ddp", "fsdp", "tp")]
    for name, label in PIPE_SCHEDULES.items():
        for m in PIPE_MICROBATCHES:
            rs = [r["bench_pipeline_bubble"][name][str(m)] for r in pair]
            if "skipped" not in rs[0]:
                ratios.append({"what": f"pipeline bubble, {label}, p=2, m={m}",
                               "ratio": statistics.mean(r["bubble"] for r in rs),
                               "against": f"its step time, same run (theory (p-1)/(m+p-1) = {rs[0]['theory']:.2f})"})
    return ratios


def _check(results: list[dict], names: list[str]) -> None:
    for rank, res in enumerate(results):
        for name in names:
            if name not in res or "error" in res[name]:
                sys.exit(f"{name} failed on rank {rank}:\n{res.get(name, {}).get('error', 'did not run')}")


def _default_ranks() -> list[int]:
    """1 and 2 on CPU; 1, 2, 4, ... up to the GPU count (and the count itself) on CUDA."""
    if not torch.cuda.is_available():
        return [1, 2]
    gpus, out, n = torch.cuda.device_count(), [], 1
    while n <= gpus:
        out.append(n)
        n *= 2
    return sorted(set(out) | {gpus})


def main() -> int:
    """One launch per world size, then print the tables."""
    parser = FedparParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed repetitions")
    parser.add_argument("--ranks", type=int, nargs="+", metavar="N", default=None,
                        help="world sizes for the DDP scaling table (1 is always added as the baseline); "
                             "default: 1 2 on CPU, 1 2 4 ... up to the GPU count on CUDA")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/parallel_bench.json"),
                        help="where to write the ratios and raw figures")
    args = parser.parse_args()
    if args.quick:
        os.environ["FEDPAR_BENCH_QUICK"] = "1"
    ranks = sorted(set(args.ranks or _default_ranks()) | {1})
    if ranks[0] < 1:
        parser.error("--ranks must be positive")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and ranks[-1] > gpus:
        parser.error(f"--ranks {ranks[-1]} needs {ranks[-1]} GPUs (one rank per GPU with NCCL); {gpus} found")
    here = Path(__file__).resolve()
    launches = sorted(set(ranks) | ({2} if not gpus or gpus >= 2 else set()))
    runs: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        for n in launches:
            names = (["bench_ddp_throughput"] if n in ranks else []) + (["bench_memory"] if n <= 2 else []) \
                + (["bench_pipeline_bubble"] if n == 2 else [])
            runs[n] = run_checks(n, here, names, Path(tmp) / f"w{n}", device="cuda" if gpus else "cpu")
            _check(runs[n], names)
    _print_tables(runs, ranks)
    print(f"\n(total {time.perf_counter() - t0:.0f} s including process start-up of {len(launches)} launches)")
    raw = {f"{n} ranks": run for n, run in runs.items()}  # each rank's check results
    print(f"wrote {write_results(args.json, _ratios(runs, ranks), raw)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
