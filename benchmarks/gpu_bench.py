"""GPU benchmark: MFU of `fedpar train` on one GPU against a bare PyTorch loop, then the FedAvg-paper round.

    .venv/bin/python benchmarks/gpu_bench.py [--quick] [--large] [--peak-tflops 989] [--json benchmarks/results/gpu_bench.json]

1. MFU. fedpar's Trainer (what `fedpar train --model gpt` runs; here in-process on random tokens) trains a GPT of
   12 layers x d_model 768 (12 heads) at block 1024, batch 16, AdamW, with and without --compile. Next to it,
   in the same process, the floor: the same model class in a bare loop (no fedpar: plain model, bf16 autocast,
   fused AdamW, SDPA, the batch copied to the GPU each step from pinned memory, no per-step sync), eager and
   with ``torch.compile(model)``. Every run takes --warmup steps first (compile happens there) and is timed over
   the next --steps steps: fedpar from its own metrics.jsonl (samples_per_second of the log intervals after the
   warm-up, log_every = --warmup), the bare loop over the same intervals of steps, with a sync at the end of
   each; samples/s is the median over the intervals (the JSON file also has every interval and the span).
   FLOPs per token = 6 N + 12 n_layer d_model T: N is the non-embedding parameter count (every parameter but
   the token embedding, whose lookup does no matmul; the output projection counts), 6 N the matmuls forward
   and backward, and 12 n_layer d_model T the attention scores and their weighted sum forward and backward
   (PaLM's convention: it counts the whole T x T matrix, although a causal kernel skips about half of it).
   MFU = FLOPs per token x tokens/s / peak bf16 FLOP/s (--peak-tflops; 989 on H100 SXM and H200, 756 on
   H100 PCIe, 312 on A100 by NVIDIA's data sheets; another GPU needs the option, else MFU prints as n/a).
   Peak memory is torch.cuda.max_memory_allocated over each run (fedpar's from its summary.json).
   On CPU (no GPU) --quick runs a tiny GPT (2 x 64, block 64, batch 8) in fp32 on one thread, eager only:
   a smoke run with samples/s and the fedpar/bare ratio, MFU n/a; without --quick the compiled runs are added.
2. FedAvg-paper round (sequential vs client-batched vs CPU simulate): benchmarks/fedavg_round_bench.py's
   ``fedavg_round(device, quick)``, run if that module exists.
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.models.gpt import GPT, GPTConfig  # noqa: E402
from fedpar.parallel.config import ParallelConfig, TrainConfig  # noqa: E402
from fedpar.datasets.arrays import LANGUAGE_MODEL, TrainData  # noqa: E402
from fedpar.parallel.config import DEVICE_HELP  # noqa: E402
from fedpar.parallel.device import check_device_layout  # noqa: E402
from fedpar.parallel.init import init_distributed, shutdown_distributed  # noqa: E402
from fedpar.parallel.trainer import Trainer  # noqa: E402
from results import write_results  # noqa: E402  (benchmarks/, this script's folder)

# bf16 dense peaks (TFLOP/s) from NVIDIA's data sheets, matched against torch.cuda.get_device_name in order.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


@dataclass(frozen=True)
class Shape:
    """The benchmarked model and batch."""

    n_layer: int
    d_model: int
    n_head: int
    block: int
    batch: int
    vocab: int = 65  # the character vocabulary of fedpar's text dataset (tinyshakespeare)

    def gpt_config(self) -> GPTConfig:
        """The GPTConfig of this shape (no dropout)."""
        return GPTConfig(vocab_size=self.vocab, block_size=self.block, n_layer=self.n_layer, n_head=self.n_head,
                         d_model=self.d_model)


GPU_SHAPE = Shape(n_layer=12, d_model=768, n_head=12, block=1024, batch=16)
# --large: a 1.2B-parameter GPT (the size the engine's FSDP/TP are for), whose matmuls keep an H100 busier.
LARGE_GPU_SHAPE = Shape(n_layer=24, d_model=2048, n_head=16, block=1024, batch=8)
CPU_SHAPE = Shape(n_layer=2, d_model=64, n_head=4, block=64, batch=8)


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters other than the token embedding (its lookup does no matmul); the output projection counts."""
    embedding = getattr(model, "tok_embeddings", None)
    skip = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def flops_per_token(n_params: int, n_layer: int, d_model: int, block: int) -> float:
    """Training FLOPs per token: 6 N for the matmuls forward and backward, plus 12 n_layer d_model T for attention."""
    return 6.0 * n_params + 12.0 * n_layer * d_model * block


def peak_for_device_name(name: str) -> float | None:
    """The data-sheet bf16 dense peak (TFLOP/s) of a GPU by its torch device name, or None if unknown."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def peak_tflops(option: float | None) -> float | None:
    """--peak-tflops if given, else the data-sheet bf16 peak of this GPU, else None (MFU n/a)."""
    if option is not None:
        return option
    return peak_for_device_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else None


def random_tokens(shape: Shape, rows: int, seed: int = 0) -> torch.Tensor:
    """``rows`` windows of ``shape.block + 1`` random token ids (inputs and targets shifted by one)."""
    return torch.randint(0, shape.vocab, (rows, shape.block + 1), generator=torch.Generator().manual_seed(seed))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _fresh() -> None:
    """Drop what the previous run left: compiled code, cached GPU blocks, the peak-memory count."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_fedpar(shape: Shape, compile: bool, warmup: int, steps: int, device: str) -> dict:
    """Trainer.run on one rank for warmup + steps steps; tokens/s of the log intervals after the warm-up."""
    _fresh()
    tokens = random_tokens(shape, shape.batch * (warmup + steps) + shape.batch)
    train, held_out = tokens[:-shape.batch], tokens[-shape.batch:]
    data = TrainData(train[:, :-1], train[:, 1:], held_out[:, :-1], held_out[:, 1:], LANGUAGE_MODEL)
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model="gpt", dataset="random-tokens", out=out, max_steps=warmup + steps,
                          batch_size=shape.batch, lr=3e-4, optimizer="adamw", block_size=shape.block,
                          log_every=warmup, eval_batches=1, plot=False, compile=compile,
                          device=device, parallel=ParallelConfig(dp=1))
        info = init_distributed(device=device)
        try:
            with contextlib.redirect_stdout(None):  # the trainer's progress lines
                summary = Trainer(cfg, lambda: GPT(shape.gpt_config()), data, info).run()
        finally:
            shutdown_distributed()
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_second"] for r in rows if r["kind"] == "train" and r["step"] > warmup]
    return {**_rates(rates, shape), "precision": summary["precision"],
            "peak_memory_bytes": summary["peak_memory_bytes"][0] if device == "cuda" else None}


def _rates(interval_rates: list[float], shape: Shape) -> dict:
    """Samples/s as the median over the timed intervals (robust to a busy machine), and over their whole span."""
    span = len(interval_rates) / sum(1.0 / r for r in interval_rates)  # equal-length intervals: harmonic mean
    median = statistics.median(interval_rates)
    return {"samples_per_second": median, "tokens_per_second": median * shape.block,
            "span_samples_per_second": span, "interval_samples_per_second": interval_rates}


def run_bare(shape: Shape, compile: bool, warmup: int, steps: int, device: str) -> dict:
    """The floor: the same GPT in a plain loop (bf16 autocast on GPU, fused AdamW, SDPA), timed like fedpar."""
    _fresh()
    device = torch.device(device)
    torch.manual_seed(0)
    model = GPT(shape.gpt_config()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, fused=True)
    step_model = torch.compile(model) if compile else model
    tokens = random_tokens(shape, shape.batch * (warmup + steps))
    if device.type == "cuda":
        tokens = tokens.pin_memory()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def step(i: int) -> torch.Tensor:
        batch = tokens[i * shape.batch:(i + 1) * shape.batch].to(device, non_blocking=True)
        x, y = batch[:, :-1], batch[:, 1:]
        with autocast:
            logits = step_model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(warmup):
        step(i)
    _sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rates = []
    for start in range(warmup, warmup + steps, warmup):  # intervals of `warmup` steps, as fedpar logs them
        t0 = time.perf_counter()
        for i in range(start, start + warmup):
            loss = step(i)
        loss.item()  # waits for the interval's last step
        rates.append(warmup * shape.batch / (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {**_rates(rates, shape), "precision": "bf16" if device.type == "cuda" else "fp32",
            "peak_memory_bytes": peak}


def bench_mfu(shape: Shape, modes: list[bool], warmup: int, steps: int, peak: float | None,
              device: str) -> dict:
    """fedpar and the bare loop, eager and/or compiled, with MFU where the GPU's peak is known."""
    n_params = non_embedding_params(GPT(shape.gpt_config()))
    per_token = flops_per_token(n_params, shape.n_layer, shape.d_model, shape.block)
    rows = []
    for compile in modes:
        for name, run in (("bare", run_bare), ("fedpar", run_fedpar)):
            label = f"{name} {'compiled' if compile else 'eager'}"
            print(f"  mfu: {label} ({warmup} warm-up + {steps} timed steps) ...", flush=True)
            r = run(shape, compile, warmup, steps, device)
            r.update(runner=name, compile=compile,
                     mfu=per_token * r["tokens_per_second"] / (peak * 1e12) if peak else None)
            rows.append(r)
    return {"shape": asdict(shape), "non_embedding_params": n_params, "flops_per_token": per_token,
            "peak_tflops": peak, "warmup_steps": warmup, "timed_steps": steps, "runs": rows}


def _fmt_gb(n: int | None) -> str:
    return f"{n / 1e9:.2f}" if n is not None else "n/a"


def print_mfu(result: dict) -> None:
    """The MFU table and the fedpar/bare ratios."""
    s, runs = result["shape"], result["runs"]
    peak = result["peak_tflops"]
    print(f"\n== MFU: GPT {s['n_layer']} x {s['d_model']} ({s['n_head']} heads), block {s['block']}, batch "
          f"{s['batch']}, vocab {s['vocab']}, AdamW; N = {result['non_embedding_params'] / 1e6:.1f}M non-embedding "
          f"parameters, {result['flops_per_token'] / 1e6:.0f} MFLOP per token; peak "
          + (f"{peak:g} TFLOP/s bf16" if peak else "unknown (MFU n/a)")
          + f"; {result['warmup_steps']} warm-up + {result['timed_steps']} timed steps ==")
    print(f"{'run':<18} | {'precision':>9} | {'samples/s':>10} | {'tokens/s':>10} | {'MFU':>6} | {'peak GB':>7}")
    for r in runs:
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "n/a"
        label = f"{r['runner']} {'compiled' if r['compile'] else 'eager'}"
        print(f"{label:<18} | {r['precision']:>9} | {r['samples_per_second']:>10.1f} | {r['tokens_per_second']:>10.0f} "
              f"| {mfu:>6} | {_fmt_gb(r['peak_memory_bytes']):>7}")
    for compile in sorted({r["compile"] for r in runs}):
        pair = {r["runner"]: r for r in runs if r["compile"] == compile}
        ratio = pair["fedpar"]["samples_per_second"] / pair["bare"]["samples_per_second"]
        result.setdefault("fedpar_over_bare", {})["compiled" if compile else "eager"] = ratio
        print(f"fedpar / bare ({'compiled' if compile else 'eager'}): {ratio:.3f}")


def run_fedavg_round(device: str, quick: bool) -> dict | None:
    """Section 2 hook: ``fedavg_round(device, quick)`` from benchmarks/fedavg_round_bench.py, if it exists."""
    try:
        from fedavg_round_bench import fedavg_round
    except ModuleNotFoundError as exc:
        if exc.name != "fedavg_round_bench":
            raise
        print("\n== FedAvg-paper round: skipped, benchmarks/fedavg_round_bench.py is missing ==")
        return None
    print("\n== FedAvg-paper round (sequential vs client-batched vs CPU simulate) ==", flush=True)
    result = fedavg_round(device, quick)
    print(json.dumps(result, indent=2))
    return result


def envelope_ratios(results: dict) -> list[dict]:
    """The same-run ratios for the results envelope: fedpar over the bare loop, MFU where the peak is known, and
    the FedAvg-paper round's client-batched speed-up."""
    ratios = []
    if results.get("mfu"):
        s = results["mfu"]["shape"]
        model = f"GPT {s['n_layer']} x {s['d_model']}, batch {s['batch']}, on {results['device']}"
        ratios += [{"what": f"fedpar trainer samples/s, {mode}, {model}", "ratio": ratio,
                    "against": "the same model in a bare PyTorch loop, same run"}
                   for mode, ratio in results["mfu"].get("fedpar_over_bare", {}).items()]
        ratios += [{"what": f"MFU, {r['runner']} {'compiled' if r['compile'] else 'eager'}, {model}",
                    "ratio": r["mfu"], "against": f"peak {results['mfu']['peak_tflops']:g} TFLOP/s bf16"}
                   for r in results["mfu"]["runs"] if r["mfu"] is not None]
    ways = (results.get("fedavg_round") or {}).get("ways", {})
    if "sequential" in ways and "batched" in ways:
        ratios.append({"what": f"FedAvg-paper round time, client-batched, on {results['device']}",
                       "ratio": ways["batched"]["seconds_per_round"] / ways["sequential"]["seconds_per_round"],
                       "against": "the clients one by one, same run"})
    if "batched" in ways and "batched_eager" in ways:
        ratios.append({"what": f"FedAvg-paper round time, client-batched, steps replayed as CUDA graphs, on "
                               f"{results['device']}",
                       "ratio": ways["batched"]["seconds_per_round"] / ways["batched_eager"]["seconds_per_round"],
                       "against": "the same stack with every step eager, same run"})
    return ratios


def main(argv: list[str] | None = None) -> int:
    """Run the sections, print their tables and write the JSON result file."""
    p = FedparParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer steps (on CPU: eager runs only)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps per run, not timed; also the length of a timed interval (default 10; quick 5)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per run, a multiple of --warmup (default 50; quick 25)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's peak bf16 TFLOP/s for MFU (default: 989 on H100/H200, from the device name)")
    p.add_argument("--only", choices=["mfu", "fedavg"], help="run one section")
    p.add_argument("--large", action="store_true",
                   help="MFU of a GPT 24 x 2048 (1.2B parameters, batch 8) instead of 12 x 768 (GPU only)")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/gpu_bench.json"),
                   help="where to write the ratios and raw figures")
    p.add_argument("--device", default="auto", help=f"{DEVICE_HELP} (one process)")
    a = p.parse_args(argv)
    warmup = a.warmup or (5 if a.quick else 10)
    steps = a.steps or 5 * warmup
    if steps % warmup:
        p.error(f"--steps {steps} must be a multiple of --warmup {warmup} (fedpar logs every --warmup steps)")
    try:
        dev = check_device_layout(a.device)
    except ValueError as exc:
        p.error(str(exc))
    gpu = torch.cuda.get_device_name() if dev == "cuda" else None
    peak = peak_tflops(a.peak_tflops)
    print(f"fedpar GPU benchmark: torch {torch.__version__}, {gpu or 'no GPU (CPU run)'}"
          + (f", peak {peak:g} TFLOP/s bf16" if peak else ""), flush=True)
    if dev == "cuda" and peak is None:
        print(f"(no known bf16 peak for {gpu}: pass --peak-tflops for MFU; it prints as n/a)")
    results: dict = {"device": gpu or "cpu", "torch": torch.__version__, "quick": a.quick}
    if dev == "cpu":
        # One intra-op thread: on a shared 2-core box, two OpenMP threads per process stalled 10-100x.
        torch.set_num_threads(1)
    if a.only in (None, "mfu"):
        shape = (LARGE_GPU_SHAPE if a.large else GPU_SHAPE) if dev == "cuda" else CPU_SHAPE
        modes = [False] if dev == "cpu" and a.quick else [False, True]
        if dev == "cpu":
            print(f"(CPU: GPT {shape.n_layer} x {shape.d_model} in fp32, 1 thread, instead of 12 x 768 in bf16; MFU n/a"
                  + ("; compiled runs skipped under --quick (Inductor's C++ compile takes ~30 s a graph here)"
                     if a.quick else "") + ")", flush=True)
        results["mfu"] = bench_mfu(shape, modes, warmup, steps, peak if dev == "cuda" else None, dev)
        print_mfu(results["mfu"])
    if a.only in (None, "fedavg"):
        results["fedavg_round"] = run_fedavg_round(dev, a.quick)
    print(f"\nwrote {write_results(a.json, envelope_ratios(results), results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
