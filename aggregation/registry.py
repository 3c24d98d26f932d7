"""Strategies by name."""

from __future__ import annotations

from typing import Any

from fedpar.aggregation.averaging import FedAvg, FedAvgM
from fedpar.aggregation.fedopt import FedAdagrad, FedAdam, FedYogi
from fedpar.aggregation.fedprox import FedProx
from fedpar.aggregation.robust import Krum, Median, MultiKrum, TrimmedMean
from fedpar.aggregation.strategy import Strategy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (FedAvg, FedAvgM, FedProx, FedAdam, FedYogi, FedAdagrad, Median, TrimmedMean, Krum, MultiKrum)
}


def strategy_names() -> list[str]:
    """Names accepted by :func:`build_strategy`."""
    return list(STRATEGIES)


def build_strategy(name: str, **kwargs: Any) -> Strategy:
    """Instantiate the strategy called ``name`` with its keyword arguments (e.g. ``proximal_mu=0.01``)."""
    key = name.strip().lower().replace("-", "_")
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    try:
        return STRATEGIES[key](**kwargs)
    except TypeError as e:
        raise ValueError(f"bad options for strategy {key!r}: {e}") from None
