"""Save and load of a checkpoint in fedpar's pickle-free DCP storage (parallel/dcp_storage.py) against DCP's own
file storage (pickled metadata, ``torch.save`` per tensor), the same state dict in the same run.

The state: a GPT-sized set of float32 tensors and their Adam moments plus plain hyper-parameters, one process
(``no_dist``); each format saved and loaded ``--repeats`` times, alternated, into the page cache (``sync_files``
off for both, so the disk's speed does not hide the formats'). Prints median seconds and the ratios.
One command:  .venv/bin/python benchmarks/dcp_storage_bench.py   (--quick: a small state, 2 repeats)
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import RESULTS, write_results  # noqa: E402  (benchmarks/, this script's folder)

from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.parallel import dcp_storage  # noqa: E402


def state(mib: int) -> dict[str, object]:
    """About ``mib`` MiB of float32 weights in 64 tensors, Adam's two moments each, and hyper-parameters."""
    per = max(1, mib * 2**20 // 4 // 3 // 64)
    torch.manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(per) for i in range(64)}
    return {"model": weights, "optim": {**{f"{k}.exp_avg": torch.randn(per) for k in weights},
                                        **{f"{k}.exp_avg_sq": torch.rand(per) for k in weights},
                                        "param_groups": {"lr": 3e-4, "betas": (0.9, 0.95), "foreach": None}}}


def blank(like: dict[str, object]) -> dict[str, object]:
    """A state of the same structure to load into."""
    if isinstance(like, dict):
        return {k: blank(v) for k, v in like.items()}
    return torch.zeros_like(like) if isinstance(like, torch.Tensor) else like


def fedpar_format(saved: dict, folder: Path) -> tuple[float, float]:
    """Seconds to save ``saved`` into ``folder`` and load it back, in fedpar's storage."""
    into = blank(saved)
    started = time.perf_counter()
    dcp.save(saved, storage_writer=dcp_storage.PlainFileSystemWriter(str(folder), sync_files=False),
             planner=dcp_storage.PlainSavePlanner(), no_dist=True)
    wrote = time.perf_counter()
    dcp_storage.load(into, folder, no_dist=True)
    return wrote - started, time.perf_counter() - wrote


def dcp_format(saved: dict, folder: Path) -> tuple[float, float]:
    """The same with DCP's own file storage and planners."""
    into = blank(saved)
    started = time.perf_counter()
    dcp.save(saved, storage_writer=FileSystemWriter(str(folder), sync_files=False), no_dist=True)
    wrote = time.perf_counter()
    dcp.load(into, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return wrote - started, time.perf_counter() - wrote


def main(argv: list[str] | None = None) -> int:
    """Alternate the two formats, print the medians and write the JSON."""
    ap = FedparParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="size of the state dict in MiB")
    ap.add_argument("--repeats", type=int, default=5, help="saves and loads of each format")
    ap.add_argument("--quick", action="store_true", help="a 16 MiB state, 2 repeats (a smoke run)")
    ap.add_argument("--json", type=Path, default=RESULTS / "dcp_storage.json", help="where the figures go")
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.repeats = 16, 2
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    saved = state(args.mib)
    times: dict[str, dict[str, list[float]]] = {"fedpar": {"save": [], "load": []}, "dcp": {"save": [], "load": []}}
    work = Path(tempfile.mkdtemp(prefix="dcp-bench-"))
    try:
        for repeat in range(args.repeats):
            for name, run in (("fedpar", fedpar_format), ("dcp", dcp_format))[:: 1 if repeat % 2 == 0 else -1]:
                folder = work / f"{name}-{repeat}"
                save_s, load_s = run(saved, folder)
                times[name]["save"].append(save_s)
                times[name]["load"].append(load_s)
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: {op: statistics.median(v) for op, v in ops.items()} for name, ops in times.items()}
    for op in ("save", "load"):
        print(f"{op}: fedpar {medians['fedpar'][op]:.3f} s, DCP's own {medians['dcp'][op]:.3f} s, "
              f"ratio {medians['fedpar'][op] / medians['dcp'][op]:.2f}")
    ratios = [{"what": f"{op} of a {args.mib} MiB checkpoint in fedpar's pickle-free storage (median of "
                       f"{args.repeats}, seconds)", "ratio": round(medians["fedpar"][op] / medians["dcp"][op], 3),
               "against": "DCP's own file storage (pickle, torch.save), alternated in the same run"}
              for op in ("save", "load")]
    path = write_results(args.json, ratios, {"mib": args.mib, "repeats": args.repeats, "seconds": times,
                                             "medians": medians})
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
