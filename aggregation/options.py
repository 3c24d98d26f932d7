"""A strategy's options, read off its constructor: names, types, defaults, and typing of text values."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from fedpar.settings import SIMPLE_TYPES, coerce_value

# Short names from the papers and other frameworks -> candidate constructor arguments (first that exists wins).
ALIASES: dict[str, tuple[str, ...]] = {
    "mu": ("proximal_mu",),
    "lr": ("server_learning_rate", "eta"),
    "momentum": ("server_momentum",),
    "beta1": ("beta_1",),
    "beta2": ("beta_2",),
    "fraction": ("beta",),
    "f": ("num_malicious",),
    "m": ("num_selected",),
}


@dataclass(frozen=True)
class OptionSpec:
    """One constructor argument that can be set from text: name, type, default and short aliases."""

    name: str
    type: type
    default: Any
    aliases: tuple[str, ...] = ()

    def describe(self, aliases: bool = True) -> str:
        """``name (alias a; float, default 0.01)``, or ``name (float, required)`` for one with no default."""
        alias = f"alias {', '.join(self.aliases)}; " if self.aliases and aliases else ""
        default = "required" if self.default is inspect.Parameter.empty else f"default {self.default!r}"
        return f"{self.name} ({alias}{self.type.__name__}, {default})"


def option_specs(cls: type) -> dict[str, OptionSpec]:
    """The options of strategy class ``cls`` that take a bool, int, float or str (e.g. not ``fold_config``)."""
    hints = typing.get_type_hints(cls.__init__)
    specs = {}
    for name, param in inspect.signature(cls).parameters.items():
        kind = hints.get(name)
        if kind in SIMPLE_TYPES and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            aliases = tuple(a for a, targets in ALIASES.items() if _alias_target(targets, cls) == name)
            specs[name] = OptionSpec(name, kind, param.default, aliases)
    return specs


def describe_options(cls: type, aliases: bool = True, leaving_out: Collection[str] = ()) -> str:
    """Human-readable list of ``cls``'s options (but ``leaving_out``), for help texts and error messages."""
    specs = [s for name, s in option_specs(cls).items() if name not in leaving_out]
    return "; ".join(s.describe(aliases) for s in specs) if specs else "none"


def typed_options(strategy: str, cls: type, raw: Mapping[str, Any], from_text: bool = True,
                  refused: Collection[str] = ()) -> dict[str, Any]:
    """``raw`` (keys maybe hyphenated) as typed constructor arguments of ``cls``; ValueError naming the valid ones
    (not those the caller ``refused``).

    Short aliases such as ``mu`` (``ALIASES``) are accepted from every caller: the command line, TOML and
    ``build_strategy`` resolve them here, one way. ``from_text`` (command line, TOML): only bool/int/float/str options
    can be set. Otherwise (Python callers) other constructor arguments (``fold_config``) pass through.
    """
    specs = option_specs(cls)
    params = inspect.signature(cls).parameters
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).strip().replace("-", "_")
        if name not in params and name in ALIASES:
            name = _alias_target(ALIASES[name], cls) or name
        if name in out:
            raise ValueError(f"option {name!r} of strategy {strategy!r} is given twice (last as {key!r})")
        if name in specs:
            out[name] = _coerce(specs[name], value, _option_label(str(key).strip(), specs[name], cls, strategy))
        elif name in params and not from_text:
            out[name] = value
        else:
            hint = _alias_target(ALIASES.get(name, ()), cls)
            hint = f" (did you mean {hint!r}?)" if hint else ""
            valid = f"valid options: {describe_options(cls, True, refused)}" if specs else "it takes no options"
            raise ValueError(f"unknown option {key!r} for strategy {strategy!r}{hint}; {valid}")
    return out


def _alias_target(targets: tuple[str, ...], cls: type) -> str | None:
    """The first of ``targets`` that ``cls``'s constructor takes."""
    params = inspect.signature(cls).parameters
    return next((t for t in targets if t in params), None)


def _option_label(typed: str, spec: OptionSpec, cls: type, strategy: str) -> str:
    """How a message names option ``spec`` that the user typed as ``typed``: as typed, with the constructor argument
    it sets when that is another name (an alias such as ``momentum``)."""
    if typed.replace("-", "_") == spec.name:
        return f"option {typed!r} of strategy {strategy!r}"
    return f"option {typed!r} ({cls.__name__}'s {spec.name}) of strategy {strategy!r}"


def _coerce(spec: OptionSpec, value: Any, label: str) -> Any:
    """``value`` as ``spec.type``; ValueError saying what was expected, naming the option as ``label``."""
    return coerce_value(spec.type, value, label)
