"""Rank body for the 2-rank gloo test: each rank folds its share of clients, then one all-reduce combines them.

Not a test module itself (no ``test_`` prefix); ``test_distributed.py`` spawns it. Results go to .npz files.
"""

from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fedpar.aggregation import FedAvg, FoldConfig, ShapesAndDtypes, WeightedSum

from fedpar.aggregation.distributed import all_reduce_weighted_sum

SHAPES = [(300, 41), (41,), (7, 3, 5), (1,)]
K = 9


def cohort(dtype, dyadic: bool, seed: int = 0):
    """The same K client updates on every rank (dyadic values make float sums order-independent)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(K):
        if dyadic:
            arrays = [(rng.integers(-64, 64, s) / 8).astype(dtype) for s in SHAPES]
        else:
            arrays = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
        out.append((arrays, int(rng.integers(1, 20))))
    return out


def rank_main(rank: int, world: int, store: str, out_dir: str) -> None:
    """Run every check on this rank and save what it computed."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    saved: dict[str, np.ndarray] = {}
    cases = {"f64_dyadic": ("float64", np.float64, True), "f64_random": ("float64", np.float64, False),
             "f32_random": ("float32", np.float32, False)}
    for name, (acc_dtype, dtype, dyadic) in cases.items():
        results = cohort(dtype, dyadic)
        cfg = FoldConfig(accumulate_dtype=acc_dtype, num_workers=2, min_parallel_elements=1)
        acc = WeightedSum(ShapesAndDtypes.of(results[0][0]), cfg)
        for arrays, n in results[rank::world]:  # this rank's share of the clients
            acc.fold(arrays, n)
        all_reduce_weighted_sum(acc)
        saved[f"{name}.count"] = np.array(acc.count)
        saved[f"{name}.total"] = np.array(acc.total_weight)
        for i, a in enumerate(acc.mean()):
            saved[f"{name}.{i}"] = a
    # the strategy path the coordinator uses: fold, all-reduce the open round's accumulator, finish
    results = cohort(np.float32, False, seed=1)
    strategy = FedAvg(FoldConfig(num_workers=2, min_parallel_elements=1))
    strategy.begin_round(1, [np.zeros(s, np.float32) for s in SHAPES])
    for j in range(rank, K, world):
        strategy.fold(*results[j], client_id=f"c{j}")
    all_reduce_weighted_sum(strategy.partial_sum())
    new, metrics = strategy.finish()
    saved["strategy.num_updates"] = np.array(metrics["num_updates"])
    for i, a in enumerate(new):
        saved[f"strategy.{i}"] = a
    # the same with the partial sums kept as torch tensors (an NCCL rank's GPU path; here on the CPU device)
    strategy = FedAvg(FoldConfig(accumulate_dtype="float64", device="cpu"))
    strategy.begin_round(1, [np.zeros(s, np.float32) for s in SHAPES])
    for j in range(rank, K, world):
        strategy.fold(*results[j], client_id=f"c{j}")
    all_reduce_weighted_sum(strategy.partial_sum())
    for i, a in enumerate(strategy.finish()[0]):
        saved[f"device.{i}"] = a
    np.savez(Path(out_dir) / f"rank{rank}.npz", **saved)
    dist.barrier()
    dist.destroy_process_group()
