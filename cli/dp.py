"""Differential-privacy options shared by ``fedpar serve`` and ``fedpar simulate``."""

from __future__ import annotations

import argparse
import math
from typing import Any

from fedpar.cli.argtypes import count, non_negative, positive, probability

# Extra per-round table columns when DP is on.
DP_COLUMNS = [("dp_epsilon", "{:>10.3f}"), ("dp_clip_norm", "{:>12.4f}")]


def add_dp_arguments(p: argparse.ArgumentParser, population_flag: bool) -> None:
    """The ``--dp*`` options; ``population_flag`` adds ``--dp-population`` (serve: the coordinator cannot know it)."""
    g = p.add_argument_group("differential privacy (DP-FedAvg; McMahan et al. 2018, Andrew et al. 2021)")
    g.add_argument("--dp", choices=("off", "central", "client"), default="off",
                   help="central: the coordinator clips every update's delta to --dp-clip and adds Gaussian noise "
                        "to the sum; client: agents clip their own update before uploading (the coordinator "
                        "verifies the bound, refuses violators, and adds the noise). Updates are weighted "
                        "uniformly, not by example count, so one client's influence stays bounded")
    g.add_argument("--dp-noise", type=non_negative, default=1.0,
                   help="noise multiplier z: the noise on the sum of clipped deltas has std z x clip norm")
    g.add_argument("--dp-clip", type=positive, default=1.0,
                   help="L2 clip norm C of each update's change to the global model (initial C if adaptive)")
    g.add_argument("--dp-adaptive-quantile", type=probability, default=None,
                   help="turn on adaptive clipping: move C each round toward this quantile of the update "
                        "norms (e.g. 0.5), using a noisy count of unclipped updates")
    g.add_argument("--dp-clip-lr", type=positive, default=0.2, help="adaptive clipping: geometric step size of C")
    g.add_argument("--dp-count-noise", type=positive, default=None,
                   help="adaptive clipping: std of the noise on the unclipped count (default clients-per-round/20; "
                        "must exceed --dp-noise / 2)")
    g.add_argument("--dp-delta", type=probability, default=1e-5,
                   help="delta at which epsilon is reported each round; pick it below 1 / population")
    g.add_argument("--dp-local-noise", type=non_negative, default=0.0,
                   help="with --dp client: agents also add N(0, (s x C)^2) to every coordinate (local DP); the "
                        "coordinator clips each noisy update back to C (the accountant's bound), which shrinks "
                        "the signal by ~1/(s sqrt(parameters)) once that noise dominates")
    if population_flag:
        g.add_argument("--dp-population", type=count, default=None,
                       help="number of agents that may be sampled (needed with --dp: it sets the sampling rate "
                            "q = agents sampled per round / population used by the privacy accountant)")


def dp_strategy(args: argparse.Namespace, strategy: str, clients_per_round: int, overselect: float,
                population: int | None) -> tuple[str, dict[str, Any]]:
    """The strategy name and DP options for the parsed flags (unchanged name and no options when DP is off)."""
    if args.dp == "off":
        return strategy, {}
    if population is None:
        raise ValueError("--dp needs --dp-population: the number of agents that may be sampled")
    sampled = min(population, math.ceil(clients_per_round * overselect))
    options = dict(noise_multiplier=args.dp_noise, clip_norm=args.dp_clip, population=population,
                   clients_per_round=clients_per_round, sampled_per_round=sampled, delta=args.dp_delta,
                   mode=args.dp, target_quantile=args.dp_adaptive_quantile, clip_learning_rate=args.dp_clip_lr,
                   count_noise=args.dp_count_noise, local_noise_multiplier=args.dp_local_noise)
    return f"dp-{strategy}", options
