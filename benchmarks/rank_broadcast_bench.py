"""The new global model going from rank 0 to the other aggregator ranks at a round's end: RankGroup.broadcast_arrays
(the tensors' bytes end to end in buckets of up to 4 MiB, one collective each) against one broadcast per tensor (what
it did before), on 2 gloo ranks on this machine, alternated, in the same run.

One command: ``.venv/bin/python benchmarks/rank_broadcast_bench.py`` (``--repeats 30``). Models: the digits MLP of
the steady-round cells (4 tensors) and a GPT-2-small-shaped list of float32 tensors (12 blocks of 12 tensors plus
embeddings and the final norm: 148 tensors, 124M parameters). Prints each way's median milliseconds per model
broadcast and their ratio; writes benchmarks/results/rank_broadcast_bench.json (``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fedpar.cli.argtypes import FedparParser

HERE = Path(__file__).resolve().parent
MODELS = {
    "digits MLP": [(64, 64), (64,), (10, 64), (10,)],
    "GPT-2-small shapes": [(50257, 768), (1024, 768)] + [s for _ in range(12) for s in (
        (768,), (768,), (2304, 768), (2304,), (768, 768), (768,), (768,), (768,), (3072, 768), (3072,), (768, 3072),
        (768,))] + [(768,), (768,)],
}


def _rank(repeats: int, out: str) -> None:
    """One rank: both ways on every model, alternated; rank 0 writes the timings."""
    import torch
    import torch.distributed as dist

    from fedpar.parallel.init import init_distributed, shutdown_distributed
    from fedpar.server.ranks.group import RankGroup

    init_distributed(timeout_seconds=120, device="cpu")
    group = RankGroup(120.0, "fedpar/ranks/bench")
    rng = np.random.default_rng(0)
    results = {}
    try:
        for name, shapes in MODELS.items():
            arrays = [rng.standard_normal(s).astype(np.float32) if dist.get_rank() == 0 else np.empty(s, np.float32)
                      for s in shapes]

            def per_tensor():
                for a in arrays:
                    dist.broadcast(torch.from_numpy(a), src=0)

            ways = {"buckets": lambda: group.broadcast_arrays(arrays), "per_tensor": per_tensor}
            seconds: dict[str, list[float]] = {w: [] for w in ways}
            for fn in ways.values():
                fn()  # first-call set-up
            for r in range(repeats):
                for w in ways if r % 2 == 0 else reversed(ways):
                    dist.barrier()
                    start = time.perf_counter()
                    ways[w]()
                    dist.barrier()  # every rank has the model
                    seconds[w].append(time.perf_counter() - start)
            results[name] = {"tensors": len(shapes), "bytes": int(sum(a.nbytes for a in arrays)),
                             **{f"{w}_ms": statistics.median(s) * 1e3 for w, s in seconds.items()}}
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        shutdown_distributed()


def main() -> int:
    """Spawn the two ranks, print and write the figures."""
    sys.path.insert(0, str(HERE))
    from results import write_results

    from fedpar.parallel.init import spawn

    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", type=Path, default=HERE / "results" / "rank_broadcast_bench.json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        spawn(2, _rank, a.repeats, str(out))
        results = json.loads(out.read_text())
    ratios = []
    print(f"{'model':<20}{'tensors':>8}{'MB':>8}{'buckets ms':>12}{'per tensor ms':>15}{'ratio':>7}")
    for name, r in results.items():
        ratio = r["buckets_ms"] / r["per_tensor_ms"]
        print(f"{name:<20}{r['tensors']:>8}{r['bytes'] / 1e6:>8.1f}{r['buckets_ms']:>12.2f}{r['per_tensor_ms']:>15.2f}"
              f"{ratio:>7.2f}")
        ratios.append({"what": f"the new model from rank 0 to rank 1 ({name}, {r['tensors']} tensors), 2 gloo ranks",
                       "ratio": ratio, "against": "one broadcast per tensor, same run"})
    print(f"wrote {write_results(a.json, ratios, {'repeats': a.repeats, 'models': results})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
