"""Strategies by name."""

from __future__ import annotations

import inspect
from typing import Any

from fedpar.aggregation.averaging import FedAvg, FedAvgM
from fedpar.aggregation.fedopt import FedAdagrad, FedAdam, FedYogi
from fedpar.aggregation.fedprox import FedProx
from fedpar.aggregation.privacy import DPStrategy
from fedpar.aggregation.robust import Krum, Median, MultiKrum, TrimmedMean
from fedpar.aggregation.strategy import Strategy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (FedAvg, FedAvgM, FedProx, FedAdam, FedYogi, FedAdagrad, Median, TrimmedMean, Krum, MultiKrum)
}


DP_PREFIX = "dp_"
DP_OPTIONS = frozenset(inspect.signature(DPStrategy).parameters) - {"inner", "fold_config"}


def strategy_names() -> list[str]:
    """Names accepted by :func:`build_strategy` (each also as ``dp-NAME``: the same under DP-FedAvg)."""
    return list(STRATEGIES)


def build_strategy(name: str, **kwargs: Any) -> Strategy:
    """Instantiate the strategy called ``name`` with its keyword arguments (e.g. ``proximal_mu=0.01``).

    ``dp-NAME`` wraps strategy NAME in :class:`DPStrategy`; the DP options (``noise_multiplier``,
    ``clip_norm``, ``population``, ``clients_per_round``, ...) go to the wrapper, the rest to NAME.
    """
    key = name.strip().lower().replace("-", "_")
    if key.startswith(DP_PREFIX):
        dp = {k: kwargs.pop(k) for k in list(kwargs) if k in DP_OPTIONS}
        if "fold_config" in kwargs:
            dp["fold_config"] = kwargs["fold_config"]
        inner = build_strategy(key[len(DP_PREFIX):], **kwargs)
        try:
            return DPStrategy(inner, **dp)
        except TypeError as e:
            raise ValueError(f"bad DP options for strategy {name!r}: {e}") from None
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    try:
        return STRATEGIES[key](**kwargs)
    except TypeError as e:
        raise ValueError(f"bad options for strategy {key!r}: {e}") from None
