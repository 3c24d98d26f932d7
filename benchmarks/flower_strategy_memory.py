"""Memory of a round under a Flower strategy run by the adapter (--strategy flower:...), against fedpar's FedAvg.

One command: ``.venv/bin/python benchmarks/flower_strategy_memory.py`` (``--params P --updates K``).

For K updates of a model of P float32 parameters it prints, in models (P x 4 bytes), the memory the strategy holds
after the K folds and its peak through ``finish``, as tracemalloc counts numpy's buffers, and each as a ratio to
fedpar's streaming FedAvg measured in the same run. Flower's FedAvg aggregates in place (one decoded update at a
time); rules built on ``flwr...aggregate()`` (FedAvgM, FedTrimmedAvg, ...) decode and weigh every update at once.
"""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path

import numpy as np

from fedpar.aggregation import build_strategy
from fedpar.cli.argtypes import FedparParser
from results import write_results  # benchmarks/, this script's folder

CONTENDERS = [("fedavg", {}), ("flower:flwr.server.strategy:FedAvg", {}),
              ("flower:flwr.server.strategy:FedAvgM", {"server_momentum": 0.9}),
              ("flower:flwr.server.strategy:FedTrimmedAvg", {"beta": 0.2})]


def measure(name: str, options: dict, global_weights: list[np.ndarray], updates: list[list[np.ndarray]]):
    """(bytes held after the folds, peak bytes through finish) of one round, counted from the first fold."""
    strategy = build_strategy(name, **options)
    strategy.begin_round(1, global_weights)
    strategy.client_config(1)
    tracemalloc.start()
    for i, update in enumerate(updates):
        strategy.fold(update, 10 + i, str(i))
    held = tracemalloc.get_traced_memory()[0]
    strategy.finish()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return held, peak


def main() -> None:
    """Print the table."""
    parser = FedparParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/flower_strategy_memory.json"),
                        help="where to write the ratios and raw figures")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # Flower warns about its metrics aggregation every first round
    rng = np.random.default_rng(0)
    g = [rng.standard_normal(args.params).astype(np.float32)]
    updates = [[g[0] + np.float32(0.01 * (i + 1))] for i in range(args.updates)]
    model = 4 * args.params
    results = {name: measure(name, options, g, updates) for name, options in CONTENDERS}
    base_held, base_peak = results["fedavg"]
    print(f"{args.updates} updates of {args.params:,} float32 parameters; memory in models ({model / 2**20:.1f} MiB)")
    print(f"{'strategy':44} {'held':>6} {'peak':>6} {'held/fedavg':>12} {'peak/fedavg':>12}")
    for name, (held, peak) in results.items():
        print(f"{name:44} {held / model:6.1f} {peak / model:6.1f} {held / base_held:11.1f}x {peak / base_peak:11.1f}x")
    against = f"fedpar's FedAvg, same run ({args.updates} updates of {args.params:,} float32 parameters)"
    ratios = [{"what": f"round memory {kind}, {name}", "ratio": figures[i] / (base_held, base_peak)[i],
               "against": against}
              for name, figures in results.items() if name != "fedavg" for i, kind in enumerate(("held", "peak"))]
    raw = {"params": args.params, "updates": args.updates,
           "bytes": {name: {"held": held, "peak": peak} for name, (held, peak) in results.items()}}
    print(f"wrote {write_results(args.json, ratios, raw)}")


if __name__ == "__main__":
    main()
