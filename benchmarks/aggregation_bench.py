"""FedAvg aggregation benchmark: fedpar's streaming/sharded fold vs Flower's aggregate / aggregate_inplace.

One command: ``.venv/bin/python benchmarks/aggregation_bench.py`` (add ``--quick`` for a smoke run).

For K clients x P float32 parameters it prints seconds, effective GB/s of update data read
(K * P * 4 bytes / seconds), that rate as a fraction of this machine's memory read bandwidth (numpy
stream-read, measured in the same run), peak extra memory, and the speed-up over Flower's best.

What is measured, exactly:
- Inputs: a pool of R distinct float32 models (R = K when K models fit in --pool-gib, else as many as
  fit), laid out as a few large matrices plus bias vectors. The K results cycle through the pool, so
  every fold reads a model that was last touched R-1 models earlier (R * model bytes > the L3 cache
  for the large cases; small cases are partly cache-resident and say so in the table).
- fedpar stream: ``fedavg(iterator)`` consuming one result at a time, with each kernel (torch, the default; numpy;
  BLAS axpy threaded by OpenBLAS).
- fedpar list: ``fedavg(list)``; the results are already in memory, so 8 are folded per pass.
- fedpar strategy: ``FedAvg().fold`` per result (with the NaN/Inf pre-check) + ``finish``; "known finite" is
  the coordinator's call, which skips that pass because the service checked the values on arrival.
- coordinator folds: the coordinator's own fold path (FoldQueue, server/round_modes.py): each result is accepted
  once it holds one of S staging slots (as an upload holds its slot until its fold is done), folded on the
  coordinator's worker threads by ``Strategy.fold_many(..., known_finite=True)``, grouped with the results that
  wait for a fold; S = 4 (the default --max-concurrent-uploads) and S = 8 (groups of the strategy's default group
  size). Timed from ``begin_round`` to the last fold (what a rank's ``rN_fold_s`` counts), without the round's one
  ``finish``.
  ``--torch-threads 1`` gives an aggregator rank's setting (one intra-op thread, longer kernel blocks).
- flwr aggregate: ``flwr.server.strategy.aggregate.aggregate(list)`` on the same arrays.
- flwr aggregate_inplace: on FitRes objects built with ``ndarrays_to_parameters`` from the same pool
  (serialization is set-up, not timed; its deserialization inside the call is timed, as Flower runs it).
- numpy read (same inputs): a.sum() over every array of every result on 2 threads, interleaved with the
  contenders: the machine's read bandwidth for exactly this data, under the same conditions.
- Peak extra memory: the larger of (a) Linux VmHWM (peak RSS) after resetting it through
  /proc/self/clear_refs, minus the RSS just before the call (counts every allocation: numpy, torch,
  the returned model) and (b) tracemalloc's peak during the first (warm-up) repeat (numpy buffers).
  Rows whose extra memory alone would exceed --mem-gib are skipped, and say so.
- Timings are the best of --repeats runs, contenders interleaved round-robin (the machine is shared;
  best-of filters other processes' load). The first touch of fresh memory is very slow in this VM
  (~100 us per 4 KiB page once), so the first repeat also serves as warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fedpar.aggregation import FedAvg, FoldConfig, FoldItem, fedavg
from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.parallel.device import flush_denormals
from fedpar.server.round_modes import FoldQueue
from fedpar.server.rounds import RoundState
from fedpar.server.uploads import update_runner

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))  # tests/support

from results import write_results  # noqa: E402  (benchmarks/, this script's folder)

GIB = 1 << 30


# ----------------------------------------------------------------------------- memory accounting
def _status_kib(field: str) -> int:
    """A VmXXX field of /proc/self/status in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_once(fn: Callable[[], object], trace: bool) -> tuple[float, int]:
    """Wall time of one call of ``fn`` and its peak extra memory in bytes: the larger of the peak-RSS growth
    and (when ``trace``) tracemalloc's peak, which numpy reports its buffers to."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    base = _status_kib("VmRSS")
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = (_status_kib("VmHWM") - base) * 1024
    if trace:
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    del out
    return dt, peak


def measure_interleaved(contenders: list[tuple[str, Callable[[], object]]], repeats: int) -> dict[str, tuple[float, int]]:
    """Best time and largest peak extra memory per contender, running them round-robin so a burst of load from
    other processes on this shared machine does not hit every repeat of one contender. The first round also
    traces allocations (and is the warm-up); later rounds run untraced."""
    best: dict[str, tuple[float, int]] = {}
    for rep in range(repeats):
        for name, fn in contenders:
            t, m = measure_once(fn, trace=rep == 0)
            bt, bm = best.get(name, (math.inf, 0))
            best[name] = (min(bt, t), max(bm, m))
    return best


# ----------------------------------------------------------------------------- bandwidth baseline
@dataclass
class Bandwidth:
    """Memory bandwidth of this machine measured with numpy (GB/s, 1e9 bytes)."""

    read_1t: float
    read_2t: float
    triad_1t: float
    triad_2t: float

    @property
    def read(self) -> float:
        """The best read bandwidth (the reference for 'fraction of read bandwidth')."""
        return max(self.read_1t, self.read_2t)


def measure_bandwidth(nbytes: int, repeats: int) -> Bandwidth:
    """numpy stream-read (a.sum) and STREAM triad (a = b + s*c, numpy two-pass) on arrays of ``nbytes``, 1 and 2 threads."""
    n = nbytes // 4
    a, b, c = (np.random.default_rng(i).random(n, dtype=np.float32) for i in range(3))
    pool = ThreadPoolExecutor(2)
    halves = [slice(0, n // 2), slice(n // 2, n)]

    def triad(sl: slice) -> None:
        np.multiply(c[sl], np.float32(1.5), out=a[sl])
        np.add(a[sl], b[sl], out=a[sl])

    def best(fn: Callable[[], object]) -> float:
        return min(_timed(fn) for _ in range(repeats))

    r1 = nbytes / best(lambda: b.sum()) / 1e9
    r2 = nbytes / best(lambda: list(pool.map(lambda s: b[s].sum(), halves))) / 1e9
    t1 = 3 * nbytes / best(lambda: triad(slice(0, n))) / 1e9
    t2 = 3 * nbytes / best(lambda: list(pool.map(triad, halves))) / 1e9
    pool.shutdown()
    return Bandwidth(r1, r2, t1, t2)


def _timed(fn: Callable[[], object]) -> float:
    """Wall time of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- inputs
def layer_sizes(p: int) -> list[int]:
    """A model of ``p`` parameters: four matrices (40/30/20/10 %) and four small bias vectors."""
    biases = [min(4096, p // 1000)] * 4
    rest = p - sum(biases)
    mats = [rest * 4 // 10, rest * 3 // 10, rest * 2 // 10]
    mats.append(rest - sum(mats))
    return [s for pair in zip(mats, biases) for s in pair]


def make_pool(p: int, r: int, seed: int = 0) -> list[list[np.ndarray]]:
    """``r`` distinct float32 models of ``p`` parameters, filled in place (no temporaries)."""
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(r):
        model = [np.empty(s, np.float32) for s in layer_sizes(p)]
        for a in model:
            rng.random(out=a, dtype=np.float32)
        pool.append(model)
    return pool


def results_from(pool: list[list[np.ndarray]], k: int) -> list[tuple[list[np.ndarray], int]]:
    """K (arrays, num_examples) results cycling through the pool (references, no copies)."""
    return [(pool[i % len(pool)], 10 + (i % 7)) for i in range(k)]


# ----------------------------------------------------------------------------- contenders
def read_all(results) -> float:
    """The read baseline under the same conditions: sum every array of every result (2 threads, one per half)."""
    with ThreadPoolExecutor(2) as pool:
        return sum(pool.map(lambda arrays: sum(float(a.sum()) for a in arrays[0]),
                            [([a[: a.size // 2] for a in u], n) for u, n in results] +
                            [([a[a.size // 2:] for a in u], n) for u, n in results]))


def fedpar_stream(results, config: FoldConfig):
    """fedavg over an iterator (one result at a time)."""
    return fedavg(iter(results), config)


def fedpar_list(results, config: FoldConfig):
    """fedavg over the list (grouped passes)."""
    return fedavg(results, config)


def fedpar_strategy(results, config: FoldConfig, known_finite: bool = False):
    """The strategy API: begin_round, fold each (with its NaN/Inf pass unless ``known_finite``), finish.
    The coordinator passes ``known_finite`` because it checks the values as they arrive."""
    s = FedAvg(config)
    s.begin_round(1, results[0][0])
    for j, (u, n) in enumerate(results):
        s.fold(u, n, f"c{j}", known_finite=known_finite)
    return s.finish()[0]


def coordinator_folds(results, slots: int, executor: ThreadPoolExecutor):
    """The coordinator's fold path: each result folds through the fold queue once it holds one of ``slots`` staging
    slots (held until its fold is done), on ``executor``'s threads, grouped with the results that wait. What a rank's
    ``rN_fold_s`` counts (the round's one ``finish`` is not timed: the strategy is returned with its sum)."""
    s = FedAvg()  # the coordinator's defaults
    s.begin_round(1, results[0][0])
    queue = FoldQueue(s, update_runner(sum(a.nbytes for a in results[0][0]), executor), known_finite=True)
    state = RoundState(1, len(results), 1, 0.0, {})

    async def upload(j: int, staging: asyncio.Semaphore) -> None:
        async with staging:
            await queue.fold(state, FoldItem(results[j][0], results[j][1], f"c{j}"))

    async def run() -> None:
        staging = asyncio.Semaphore(slots)
        await asyncio.gather(*(upload(j, staging) for j in range(len(results))))
    asyncio.run(run())
    return s


@dataclass
class Row:
    """One line of the table."""

    k: int
    p: int
    method: str
    seconds: float | None
    peak_bytes: int | None
    note: str = ""


def run_cell(k: int, p: int, args: argparse.Namespace, flwr_mods) -> list[Row]:
    """Every contender on K x P."""
    model_bytes = 4 * p
    r = max(1, min(k, int(args.pool_gib * GIB) // model_bytes))
    pool = make_pool(p, r)
    results = results_from(pool, k)
    cache_note = "in L3" if r * model_bytes <= args.l3_bytes else ""
    reps = args.repeats if k * model_bytes <= 4 * GIB else max(1, args.repeats - 1)
    rows = []
    contenders = [
        ("numpy read (same inputs)", lambda: read_all(results)),
        ("fedpar stream torch (default)", lambda: fedpar_stream(results, FoldConfig())),
        ("fedpar stream numpy", lambda: fedpar_stream(results, FoldConfig(backend="numpy"))),
        ("fedpar stream blas", lambda: fedpar_stream(results, FoldConfig(backend="blas"))),
        ("fedpar list (default)", lambda: fedpar_list(results, FoldConfig())),
        ("fedpar strategy.fold", lambda: fedpar_strategy(results, FoldConfig())),
        ("fedpar strategy known-finite", lambda: fedpar_strategy(results, FoldConfig(), True)),
        ("coordinator folds, 4 slots", lambda: coordinator_folds(results, 4, executor)),
        ("coordinator folds, 8 slots", lambda: coordinator_folds(results, 8, executor)),
    ]
    executor = ThreadPoolExecutor(max(2, os.cpu_count() or 2))  # as the coordinator's (server/ranks/plane.py)
    skip_flwr = flwr_mods is not None and k * model_bytes * 2 > args.mem_gib * GIB
    if flwr_mods is not None and not skip_flwr:
        contenders.append(("flwr aggregate", lambda: flwr_mods[0].aggregate(results)))
    best = measure_interleaved(contenders, reps)
    executor.shutdown()
    rows += [Row(k, p, name, *best[name], cache_note) for name, _ in contenders]
    if flwr_mods is None:
        rows.append(Row(k, p, "flwr (not installed)", None, None, "pip install flwr"))
    else:
        agg, FitRes, Status, Code, to_params = flwr_mods
        if skip_flwr:
            rows.append(Row(k, p, "flwr aggregate", None, None,
                            f"skipped: its K weighted copies need {k * model_bytes / GIB:.0f} GiB"))
        serialized = [to_params(model) for model in pool]
        del pool, results, contenders
        gc.collect()
        fit = [(None, FitRes(Status(Code.OK, ""), serialized[i % r], 10 + (i % 7), {})) for i in range(k)]
        best = measure_interleaved([("inplace", lambda: agg.aggregate_inplace(fit))], reps)
        rows.append(Row(k, p, "flwr aggregate_inplace", *best["inplace"], "includes np.load of each result"))
        del fit, serialized
    gc.collect()
    return rows


def load_flwr():
    """Flower's aggregation functions and result types, or None if flwr is absent."""
    try:
        from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
        from flwr.server.strategy import aggregate as agg
    except ImportError:
        return None
    return agg, FitRes, Status, Code, ndarrays_to_parameters


HEADER = (f"{'K':>4} {'P':>5} {'method':<28} {'seconds':>8} {'GB/s':>7} {'x read':>7} "
          f"{'peak extra':>11} {'models':>7} {'vs flwr best':>12}  note")


def print_table(rows: list[Row], bw: Bandwidth) -> None:
    """The results with GB/s, fraction of read bandwidth, memory in models, and speed-up vs Flower's best."""
    for (k, p) in dict.fromkeys((r.k, r.p) for r in rows):
        cell = [r for r in rows if (r.k, r.p) == (k, p)]
        flwr_times = [r.seconds for r in cell if r.method.startswith("flwr") and r.seconds]
        flwr_best = min(flwr_times) if flwr_times else None
        reads = [r.seconds for r in cell if r.method.startswith("numpy read") and r.seconds]
        read_gbs = k * p * 4 / reads[0] / 1e9 if reads else bw.read
        for r in cell:
            pm = f"{p / 1e6:g}M"
            if r.seconds is None:
                print(f"{k:>4} {pm:>5} {r.method:<28} {'-':>8} {'-':>7} {'-':>7} {'-':>11} {'-':>7} {'-':>12}  {r.note}")
                continue
            gbs = k * p * 4 / r.seconds / 1e9
            mem = f"{r.peak_bytes / 2**20:,.0f} MiB"
            models = r.peak_bytes / (4 * p)
            vs = f"{flwr_best / r.seconds:.2f}x" if flwr_best else "-"
            print(f"{k:>4} {pm:>5} {r.method:<28} {r.seconds:8.3f} {gbs:7.2f} {gbs / read_gbs:7.2f} "
                  f"{mem:>11} {models:7.2f} {vs:>12}  {r.note}")


def cell_ratios(rows: list[Row]) -> list[dict]:
    """Envelope ratios of one table: each fedpar method's rate over the cell's numpy read, and Flower's best time
    over fedpar's coordinator folds."""
    ratios = []
    for (k, p) in dict.fromkeys((r.k, r.p) for r in rows):
        cell = {r.method: r for r in rows if (r.k, r.p) == (k, p) and r.seconds}
        name = f"K={k} x {p / 1e6:g}M float32"
        read = cell.get("numpy read (same inputs)")
        flwr = [r.seconds for m, r in cell.items() if m.startswith("flwr")]
        for method in ("fedpar stream torch (default)", "coordinator folds, 4 slots", "coordinator folds, 8 slots"):
            if method in cell and read:
                ratios.append({"what": f"{name}, {method}, rate", "ratio": read.seconds / cell[method].seconds,
                               "against": "numpy read of the same inputs, same cell"})
            if method in cell and flwr:
                ratios.append({"what": f"{name}, {method}, speed", "ratio": min(flwr) / cell[method].seconds,
                               "against": "Flower's best (aggregate / aggregate_inplace), same cell"})
    return ratios


# ----------------------------------------------------------------------------- compression effect
def compression_table(rounds: int) -> list[dict]:
    """Digits FL (10 clients, MLP) with each compression method: bytes sent per round and final test accuracy."""
    from torch import nn

    from fedpar.aggregation import CompressionConfig, Compressor, encode_update
    from support.compression_refs import decode_update
    from fedpar.datasets import load_digits
    from fedpar.models import build_model, get_weights, set_weights

    torch.set_num_threads(1)
    flush_denormals()
    data = load_digits(seed=0)
    xtr, ytr = data.train.to_tensors()
    xte, yte = data.test.to_tensors()
    parts = np.array_split(np.random.default_rng(0).permutation(len(ytr)), 10)
    print(f"\nUpdate compression on sklearn digits (10 clients, MLP 64-64-10, {rounds} rounds, E=3, lr 0.3):")
    print(f"{'method':<18} {'bytes/round':>12} {'vs raw':>7} {'test acc':>9}")
    rows = []
    for method, kw in [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {"seed": 0}),
                       ("topk", {"topk_ratio": 0.1}), ("topk", {"topk_ratio": 0.01})]:
        torch.manual_seed(0)
        model = build_model("mlp", in_features=64, hidden=(64,), num_classes=10)
        comp = Compressor(CompressionConfig(method=method, **kw))
        gen = torch.Generator().manual_seed(1)
        g = get_weights(model)
        sent = []
        for r in range(rounds):
            strategy = FedAvg()
            strategy.begin_round(r + 1, g)
            sent_bytes = raw = 0  # this round's
            for c, idx in enumerate(parts):
                set_weights(model, g)
                opt = torch.optim.SGD(model.parameters(), lr=0.3)
                for _ in range(3):
                    for b in torch.randperm(len(idx), generator=gen).split(32):
                        opt.zero_grad()
                        nn.functional.cross_entropy(model(xtr[idx][b]), ytr[idx][b]).backward()
                        opt.step()
                new = get_weights(model)
                enc = encode_update(comp, new, g, f"c{c}")
                sent_bytes += enc.nbytes
                raw += sum(a.nbytes for a in new)
                strategy.fold(decode_update(comp, enc, g), len(idx), f"c{c}")
            g, _ = strategy.finish()
            sent.append(sent_bytes)
        set_weights(model, g)
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
        label = method + (f" {kw['topk_ratio']:g}" if "topk_ratio" in kw else "")
        print(f"{label:<18} {np.mean(sent):12,.0f} {raw / np.mean(sent):6.1f}x {acc:9.4f}")
        rows.append({"method": label, "bytes_per_round": float(np.mean(sent)), "raw_bytes_per_round": raw,
                     "test_accuracy": acc})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Parse options, measure bandwidth, run every cell, print the tables."""
    ap = FedparParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="P=1M only, two repeats, small bandwidth arrays, 3-round compression table")
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100], help="cohort sizes K")
    ap.add_argument("--params", type=float, nargs="+", default=[1, 10, 50], help="model sizes P in millions")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is reported)")
    ap.add_argument("--pool-gib", type=float, default=4.0, help="memory for distinct input models")
    ap.add_argument("--mem-gib", type=float, default=16.0, help="skip contenders needing more extra memory")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0, help="array size for the bandwidth baseline")
    ap.add_argument("--no-compression", action="store_true", help="skip the digits compression table")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/aggregation_bench.json"),
                    help="where to write the ratios and raw figures")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default); 1 is an aggregator rank's setting, where the "
                         "fold kernel takes longer blocks (aggregation/accumulator.py)")
    args = ap.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)  # before any fold thread starts: each takes it at its first op
    # Load scipy's BLAS (the default fold kernel) once up front: a library load, not memory of any aggregation.
    fedavg([([np.ones(4, np.float32)], 1)])
    if args.quick:
        args.params, args.repeats, args.bandwidth_gib = [1], 2, 0.25
    args.l3_bytes = _l3_bytes()
    flwr_mods = load_flwr()
    print(f"fedpar aggregation benchmark  (cpus={os.cpu_count()}, torch threads {torch.get_num_threads()}, "
          f"L3={args.l3_bytes / 2**20:.0f} MiB, "
          f"numpy {np.__version__}, python {sys.version.split()[0]}, load avg {os.getloadavg()[0]:.1f})")
    bw = measure_bandwidth(int(args.bandwidth_gib * GIB), args.repeats + 1)
    print(f"memory bandwidth (numpy, {args.bandwidth_gib:g} GiB arrays): read 1 thread {bw.read_1t:.1f} GB/s, "
          f"2 threads {bw.read_2t:.1f} GB/s; STREAM triad 1 thread {bw.triad_1t:.1f} GB/s, "
          f"2 threads {bw.triad_2t:.1f} GB/s\n'x read' = update GB/s / GB/s of 'numpy read (same inputs)' in the same cell "
          "(memory speed in this VM swings 0.4-14 GB/s from minute to minute, so the cell's own read is the fair baseline)\n")
    print(HEADER)
    print("-" * len(HEADER), flush=True)
    ratios, cells = [], []
    for p_m in args.params:
        for k in args.clients:
            rows = run_cell(k, int(p_m * 1_000_000), args, flwr_mods)
            print_table(rows, bw)  # one cell at a time
            sys.stdout.flush()
            ratios += cell_ratios(rows)
            cells += [{"clients": r.k, "params": r.p, "method": r.method, "seconds": r.seconds,
                       "peak_extra_bytes": r.peak_bytes, "note": r.note} for r in rows]
    print(f"\nload avg after: {os.getloadavg()[0]:.1f}")
    raw = {"bandwidth_gbps": vars(bw), "torch_threads": torch.get_num_threads(), "cells": cells}
    if not args.no_compression:
        raw["compression"] = compression_table(rounds=3 if args.quick else 10)
        ratios += [{"what": f"digits update bytes per round, {row['method']}",
                    "ratio": row["bytes_per_round"] / row["raw_bytes_per_round"], "against": "raw float32 update"}
                   for row in raw["compression"] if row["method"] != "none"]
    print(f"wrote {write_results(args.json, ratios, raw)}")
    return 0


def _l3_bytes() -> int:
    """Size of the last-level cache from sysfs (0 if unknown)."""
    try:
        text = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
    except OSError:
        return 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


if __name__ == "__main__":
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # A fixed mmap threshold stops glibc from serving big arrays out of already-resident heap
        # (its dynamic threshold would), so peak-RSS growth really counts every large allocation.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sys.exit(main())
