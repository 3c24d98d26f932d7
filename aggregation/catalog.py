"""The strategies there are: each strategy class registers itself with ``@register_strategy`` in its own module of
fedpar.aggregation, and :func:`strategy_classes` finds them (importing those modules on first use: some import
torch, and the command line lists the strategies only when it shows help)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from fedpar.discovery import import_declaring

PACKAGE = "fedpar.aggregation"
FIRST = "fedavg"  # the default strategy, and the one the others are read against: listed first
_T = TypeVar("_T", bound=type)
_REGISTERED: dict[str, type] = {}
_FOUND: dict[str, type] = {}


def register_strategy(cls: _T) -> _T:
    """Class decorator: offer strategy ``cls`` by its ``name`` (``--strategy NAME``, ``build_strategy(NAME)``)."""
    name = getattr(cls, "name", "")
    if not name or name != name.lower() or "-" in name or ":" in name:
        raise TypeError(f"{cls.__qualname__}: a registered strategy needs a lower-case name without '-' or ':', "
                        f"got {name!r}")
    if not isinstance(getattr(cls, "linear", None), bool):
        raise TypeError(f"{cls.__qualname__} must declare linear = True or False (aggregation/strategy.py says what "
                        "it means)")
    known = _REGISTERED.get(name)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise TypeError(f"strategy name {name!r} is taken by {known.__module__}.{known.__qualname__}")
    _REGISTERED[name] = cls
    init = cls.__init__
    cls.__init__ = _typed_init(cls, getattr(init, "unchecked", init))  # an inherited one: checked as this class's
    return cls


def _typed_init(cls: type, init: Callable) -> Callable:
    """``init``, first refusing an option of the wrong type with a TypeError naming it (the command line's
    --strategy-option arrives typed already: this is for a program's ``FedAvgM(server_learning_rate='1')``, which
    would fail deep in a comparison)."""
    @functools.wraps(init)
    def checked(self, *args: Any, **kwargs: Any) -> None:
        from fedpar.aggregation.options import option_specs
        from fedpar.settings import check_type

        try:
            given = inspect.signature(init).bind(self, *args, **kwargs).arguments
        except TypeError:  # a missing or unknown argument: Python's own words, from the call itself
            given = {}
        for spec in option_specs(cls).values():
            if spec.name in given and not (given[spec.name] is None and spec.default is None):
                check_type(spec.type, given[spec.name], f"{cls.__name__}'s {spec.name}")
        init(self, *args, **kwargs)
    checked.unchecked = init
    return checked


def strategy_classes() -> dict[str, type]:
    """Every registered strategy of fedpar.aggregation by name: fedavg first, then the linear ones, then the rest,
    each group by module and, within a module, in the order it defines them."""
    if not _FOUND:
        import_declaring(PACKAGE, register_strategy.__name__)
        order = {name: i for i, name in enumerate(_REGISTERED)}  # registration order: a module's definition order
        ours = [(name, cls) for name, cls in _REGISTERED.items() if cls.__module__.startswith(PACKAGE + ".")]
        ours.sort(key=lambda item: (item[0] != FIRST, not item[1].linear, item[1].__module__, order[item[0]]))
        _FOUND.update(ours)
    return dict(_FOUND)
