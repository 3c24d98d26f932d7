"""benchmarks/gpu_bench.py: its FLOP count, the GPU peak table, and a --quick smoke run on this machine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"


@pytest.fixture(scope="module")
def bench():
    """The benchmark script as a module."""
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_flops_per_token_of_the_gpt2_small_shape(bench):
    """12 x 768, 12 heads, vocab 65: N = 12 (4 d^2 + 8 d^2 + 2 d) + d (final norm) + 65 d (output projection)."""
    d = 768
    model = bench.GPT(bench.GPU_SHAPE.gpt_config())
    n = bench.non_embedding_params(model)
    assert n == 12 * (12 * d * d + 2 * d) + d + 65 * d == 85_003_776
    assert bench.flops_per_token(n, 12, d, 1024) == 6 * n + 12 * 12 * d * 1024


def test_peak_flops_by_device_name_and_option(bench):
    assert bench.peak_for_device_name("NVIDIA H100 80GB HBM3") == 989.0
    assert bench.peak_for_device_name("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_for_device_name("NVIDIA GeForce RTX 4090") is None
    assert bench.peak_tflops(500.0) == 500.0


def test_quick_run_reports_throughput_and_the_ratio_to_the_bare_loop(tmp_path: Path):
    out = tmp_path / "gpu_bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--only", "mfu", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    envelope = json.loads(out.read_text())
    result = envelope["results"]["mfu"]
    assert envelope["ratios"][0]["what"].startswith("fedpar trainer samples/s, eager")
    runs = {(r["runner"], r["compile"]): r for r in result["runs"]}
    assert {runner for runner, _ in runs} == {"bare", "fedpar"}
    assert all(r["samples_per_second"] > 0 and len(r["interval_samples_per_second"]) == 5 for r in runs.values())
    assert "fedpar / bare (eager)" in proc.stdout
    if result["peak_tflops"] is None:
        assert all(r["mfu"] is None for r in runs.values()) and "n/a" in proc.stdout
