"""Strategies by name: the registered ones (aggregation/catalog.py), ``dp-NAME`` and ``flower:REF``."""

from __future__ import annotations

import inspect
from typing import Any

from fedpar.aggregation.catalog import strategy_classes
from fedpar.aggregation.compatibility import check_composition
from fedpar.aggregation.options import option_specs, typed_options
from fedpar.aggregation.privacy import DPStrategy
from fedpar.aggregation.strategy import FLOWER_PREFIX, Strategy


DP_PREFIX = "dp_"
DP_OPTIONS = frozenset(inspect.signature(DPStrategy).parameters) - {"inner", "fold_config"}


def strategy_names() -> list[str]:
    """Names accepted by :func:`build_strategy` (each also as ``dp-NAME``: the same under DP-FedAvg)."""
    return list(strategy_classes())


def build_strategy(name: str, **kwargs: Any) -> Strategy:
    """Instantiate the strategy called ``name`` with its keyword arguments (e.g. ``proximal_mu=0.01``, or by the
    short alias the command line also takes, ``mu=0.01``).

    ``dp-NAME`` wraps strategy NAME in :class:`DPStrategy`; the DP options (``noise_multiplier``,
    ``clip_norm``, ``population``, ``clients_per_round``, ...) go to the wrapper, the rest to NAME.
    """
    if _flower_name(name):
        return _flower_module().build_flower_strategy(name, **kwargs)
    key = name.strip().lower().replace("-", "_")
    if key.startswith(DP_PREFIX):
        check_composition(name)
        dp = {k: kwargs.pop(k) for k in list(kwargs) if k in DP_OPTIONS}
        if "fold_config" in kwargs:
            dp["fold_config"] = kwargs["fold_config"]
        inner = build_strategy(name.strip()[len(DP_PREFIX):], **kwargs)  # (a flower: reference keeps its case)
        missing = [p.name for p in inspect.signature(DPStrategy).parameters.values()
                   if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "inner"
                   and p.name not in dp]
        if missing:  # Python's own words would name the wrapper's parameters, which no flag has
            raise ValueError(f"strategy {name!r} is the DP wrapper, built with {len(missing)} DP option(s) it was "
                             f"not given; give --strategy {name.strip()[len(DP_PREFIX):]} with --privacy central (or "
                             "client) and its --privacy-* settings, which set them")
        return DPStrategy(inner, **dp)
    cls = strategy_class(name)
    try:
        options = typed_options(key, cls, kwargs, from_text=False)
    except ValueError as e:
        raise ValueError(f"bad options: {e}") from None
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"bad options for strategy {key!r}: {e}") from None


def strategy_class(name: str) -> type:
    """The class of strategy ``name`` (``dp-NAME``: NAME's; ``flower:REF``: the Flower class); ValueError listing
    the choices when unknown."""
    key = name.strip().lower().replace("-", "_")
    if key.startswith(DP_PREFIX):  # (a flower: reference keeps its case)
        name, key = name.strip()[len(DP_PREFIX):], key[len(DP_PREFIX):]
    if _flower_name(name):
        return _flower_module().flower_class(name)
    classes = strategy_classes()
    if key not in classes:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(classes)}, "
                         f"or flower:package.module:Class for a Flower strategy")
    return classes[key]


def strategy_name(name: str) -> str:
    """The name a strategy built from ``name`` has (the DP wrapper's for ``dp-NAME``), without building it; ValueError
    for an unknown one."""
    wrapped = name.strip().lower().replace("-", "_").startswith(DP_PREFIX)
    bare = name.strip()[len(DP_PREFIX):] if wrapped else name.strip()
    cls = strategy_class(bare)
    inner = bare if _flower_name(bare) else cls.name  # a Flower strategy is named by its reference
    return DPStrategy.wrapping(inner) if wrapped else inner


def parse_strategy_options(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Typed constructor options of strategy ``name`` from text or TOML values; short aliases (``mu``) allowed."""
    if _flower_name(name):
        return _flower_module().flower_options(name, strategy_class(name), raw, from_text=True)
    return typed_options(name, strategy_class(name), raw, from_text=True)


def _flower_name(name: str) -> bool:
    """``flower:REFERENCE``: a Flower strategy class (aggregation/flower_strategy.py)."""
    return name.strip().lower().startswith(FLOWER_PREFIX)


def _flower_module():
    """aggregation/flower_message_strategy.py (Message-API strategies; legacy ones it hands to
    aggregation/flower_strategy.py), which needs Flower: a one-line ValueError when flwr is not installed."""
    try:
        from fedpar.aggregation import flower_message_strategy
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "flwr":
            raise
        raise ValueError("--strategy flower:... runs a Flower strategy and needs Flower: "
                         "pip install 'fedpar[flower]'") from None
    return flower_message_strategy


def strategy_options_help() -> str:
    """Every strategy's settable options, strategies with the same option names grouped."""
    groups: dict[str, list[str]] = {}
    for key, cls in strategy_classes().items():
        specs = option_specs(cls)
        if specs:
            names = ", ".join(f"{s.name} ({'/'.join(s.aliases)})" if s.aliases else s.name for s in specs.values())
            groups.setdefault(names, []).append(key)
    return "; ".join(f"{'/'.join(keys)}: {names}" for names, keys in groups.items())
