"""A spawn harness for multi-rank checks: run named check functions of a file in one process group.

The spawned ranks unpickle :func:`_worker` by module name (``support.spawn_checks``), which they find on the
``sys.path`` they inherit from the parent (pytest's ``pythonpath``, or the benchmark's own insert).
"""

from __future__ import annotations

import importlib.util
import json
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from fedpar.parallel.device import flush_denormals
from fedpar.parallel.init import init_distributed, rank_start_method, shutdown_distributed, spawn


def backend_id(device: str) -> str:
    """The backend a group on ``device`` uses, for test ids: ``"nccl"`` on GPUs, ``"gloo"`` on the CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def _worker(checks_file: str, names: list[str], out_dir: str, device: str) -> None:
    info = init_distributed(timeout_seconds=60, device=device)
    flush_denormals()
    spec = importlib.util.spec_from_file_location(f"fedpar_checks_{Path(checks_file).stem}", checks_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results: dict[str, Any] = {}
    out = Path(out_dir) / f"rank{info.rank}.json"
    try:
        for name in names:
            start = time.perf_counter()
            try:
                results[name] = getattr(module, name)()
                results[name]["seconds"] = round(time.perf_counter() - start, 3)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
                raise  # the peers fail fast on the closed connection rather than wait in a collective
            finally:
                out.write_text(json.dumps(results))
        torch.distributed.barrier()  # leave together (rank 0 hosts the store; see parallel/run.py)
    finally:
        shutdown_distributed()


def run_checks(nproc: int, checks_file: str | Path, names: list[str], out_dir: str | Path,
               device: str = "cpu") -> list[dict[str, Any]]:
    """Run check functions ``names`` of ``checks_file`` in one spawned group on ``device``; return each rank's results.

    Every check returns a JSON-able dict of numbers. A failing check stops the group; its traceback is kept
    in the results of the ranks that raised, and later checks are missing.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    error: BaseException | None = None
    try:
        # forked from the fork server in a test process (it has served gRPC): torch is imported once, not per rank
        spawn(nproc, _worker, str(checks_file), list(names), str(out_dir), device, start_method=rank_start_method())
    except Exception as exc:  # keep partial results; the tests report which check failed and why
        error = exc
    results = []
    for r in range(nproc):
        path = out_dir / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.is_file() else {})
    if error is not None and not any(results):
        raise error
    return results
