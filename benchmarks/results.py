"""One envelope for the JSON a benchmark writes: when and where it ran, the command, its ratios against the
same-run baseline, and its raw figures. The documentation's benchmarks page is generated from these files
(benchmarks/results/*.json; docs/hooks/benchmarks_page.py)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SMOKE = Path(__file__).resolve().parents[1] / "runs" / "benchmarks"  # where a --quick run's figures go (ignored by git)


def machine() -> str:
    """This machine in words: CPU cores, memory, and the GPU torch sees (if any)."""
    words = [f"{os.cpu_count()} CPU cores", platform.machine()]
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        words.append(f"{pages * size / 2**30:.0f} GiB memory")
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import torch
        words.append(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
    except ImportError:
        pass
    return ", ".join(words)


def destination(path: Path, argv: list[str]) -> Path:
    """Where ``path`` is written: a --quick smoke run's figures go to runs/benchmarks/, not over the published ones."""
    path = Path(path)
    if "--quick" in argv[1:] and path.resolve().parent == RESULTS:
        return SMOKE / path.name
    return path


def write_results(path: Path, ratios: list[dict], results: object, argv: list[str] | None = None) -> Path:
    """Write ``path`` (a --quick run's under runs/benchmarks/ instead of benchmarks/results/): the envelope around
    ``results`` (the benchmark's own figures) with ``ratios``, each ``{"what": ..., "ratio": float, "against": the
    same-run baseline}``. Returns the path written."""
    argv = sys.argv if argv is None else argv
    envelope = {"benchmark": Path(argv[0]).name, "date": datetime.date.today().isoformat(), "machine": machine(),
                "command": "python " + shlex.join([f"benchmarks/{Path(argv[0]).name}", *argv[1:]]),
                "ratios": ratios, "results": results}
    path = destination(path, argv)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(envelope, indent=2) + "\n")
    return path
