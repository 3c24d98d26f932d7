"""Settings declared once: a dataclass field that also carries its command-line help, section and range.

``fedpar.cli.declared`` turns such fields into argparse options and TOML keys, so a setting's name, type, default,
help and range are written in one place, its dataclass. Settings come in sections (small dataclasses: rounds and
sampling, data and model, device, ...); a command's config is composed of the sections it uses (it inherits them),
and one config hands another the sections they share with :func:`composed`. This module depends on nothing: every
room may use it.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

# Metadata keys of a declared field.
HELP, GROUP, CHECK, FLAG, KEY, CHOICES, METAVAR, APPEND, SITE, RESUME = (
    "help", "group", "check", "flag", "key", "choices", "metavar", "append", "site", "resume")
# What a simulation resumed from its --checkpoint-dir does with a setting given another value than its rounds ran
# with (``setting(resume=...)``; simulations/resume.py): another value DEFINES another federation (the clients, the
# data each holds, the model, the task, the clock its time is counted on: the resume is refused); a NOTED one only
# changes how the remaining rounds train (said in one line, and resumed); an UNRECORDED one is how the run is hosted
# here, or a guard (neither).
DEFINES, NOTED, UNRECORDED = "defines", "noted", "unrecorded"


def setting(default: Any = dataclasses.MISSING, *, help: str, group: str | None = None, check: str | None = None,
            flag: str | None = None, key: str | None = None, choices: Any = None, metavar: str | None = None,
            append: bool = False, default_factory: Any = dataclasses.MISSING,
            resume: str | None = None) -> Any:
    """A dataclass field that is also a command-line option.

    ``check`` names a range-checked type of ``fedpar.ranges`` (``count``, ``port``, ``probability``, ...: a config
    built in Python is checked against it too, :func:`check_declared`) or another of ``fedpar.cli.argtypes``;
    ``flag`` is the option's name without dashes when it is not the field's (``lr`` for ``learning_rate``);
    ``key`` is its TOML key and argparse dest when not the field's name; ``choices`` a tuple of allowed values, or a
    dict from the words the command line takes to the values the field holds; a bool field's flag comes with its
    opposite, ``--no-FLAG`` (the command line can turn a --config file's value off);
    ``append``: a list field whose flag may be repeated (a dict field's flag always may: ``KEY=VALUE`` each time);
    ``resume``: :data:`DEFINES`, :data:`NOTED` or :data:`UNRECORDED`, for a setting a simulation has (its resume's
    check: :meth:`fedpar.simulations.config.SimulationConfig.resume_record`).
    """
    caller = sys._getframe(1)
    metadata = {HELP: help, GROUP: group, CHECK: check, FLAG: flag, KEY: key, CHOICES: choices,
                METAVAR: metavar, APPEND: append, RESUME: resume,
                SITE: f"{caller.f_globals.get('__name__', '?')}:{caller.f_lineno}"}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def redefault(section: type, name: str, default: Any = dataclasses.MISSING, *,
              default_factory: Any = dataclasses.MISSING) -> Any:
    """Field ``name`` of section ``section`` with another default, for a config composed of that section whose
    use of the setting starts elsewhere (its help says why); the declaration (help, range, flag) stays the
    section's."""
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=dict(f.metadata))


def setting_site(f: dataclasses.Field) -> str:
    """Where the setting of field ``f`` is declared (``module:line`` of its :func:`setting` call)."""
    return f.metadata.get(SITE, "?")


def sections_of(cls: type) -> list[type]:
    """The section dataclasses ``cls`` is composed of (its dataclass bases), ``cls`` itself not included."""
    return [c for c in cls.__mro__[1:] if dataclasses.is_dataclass(c)]


def composed(cls: type, source: Any, **overrides: Any) -> Any:
    """An instance of config ``cls`` holding every setting of the sections it shares with ``source`` (an instance
    of another config composed of some of the same sections) as ``source`` holds it, then ``overrides``: one config
    passes its sections to another without naming their settings."""
    shared = [c for c in sections_of(cls) if isinstance(source, c)]
    values = {f.name: getattr(source, f.name) for c in shared for f in dataclasses.fields(c) if f.init}
    return cls(**{**values, **overrides})


def declared_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` declared with :func:`setting`, in declaration order."""
    return [f for f in dataclasses.fields(cls) if HELP in f.metadata]


def setting_key(f: dataclasses.Field) -> str:
    """The TOML key (and argparse dest) of a declared field."""
    return f.metadata.get(KEY) or f.name


def flag_of(cls: type, name: str) -> str:
    """The command-line flag of field ``name`` of ``cls`` (``--dp-replicate`` for ParallelConfig.dp)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return "--" + (f.metadata.get(FLAG) or setting_key(f).replace("_", "-"))


def word_for(choices: dict, value: Any) -> Any:
    """The command-line word of ``choices`` whose value is ``value`` (``value`` itself when there is none)."""
    return next((word for word, v in choices.items() if v is value or v == value and type(v) is type(value)), value)


def as_given(cls: type, name: str, value: Any) -> Any:
    """``value`` of field ``name`` of ``cls`` as its flag is given it: a choice's word (``--clock virtual``, not
    True), else ``value``."""
    choices = next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get(CHOICES)
    return word_for(choices, value) if isinstance(choices, dict) else value


def check_declared(config: Any) -> None:
    """TypeError or ValueError naming the field when a setting of ``config`` declared with a range (``check``, a
    name of :mod:`fedpar.ranges`) is not a number of its kind or is out of that range: the checks the command line
    makes as it parses, for a config a program builds (None passes where it is the default)."""
    import argparse

    from fedpar import ranges

    for f in declared_fields(type(config)):
        parse = getattr(ranges, f.metadata[CHECK] or "", None)
        value = getattr(config, f.name)
        if parse is None or value is None and f.default is None:
            continue
        where = f"{type(config).__name__}'s {f.name}"
        check_type(parse.kind, value, where)
        try:
            parse(str(value))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{where}: {exc}") from None


SIMPLE_TYPES = (bool, int, float, str)  # what an option given as text (command line, TOML) can be
_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def check_type(kind: type, value: Any, where: str) -> None:
    """TypeError starting with ``where`` unless ``value`` is a ``kind`` (bool, int, float or str) as a program gives
    it: an int for a float, never a bool for a number nor text for either (the command line's text is made the
    type first, by :func:`coerce_value`)."""
    import numbers

    ok = (isinstance(value, bool) if kind is bool else isinstance(value, str) if kind is str
          else not isinstance(value, bool) and isinstance(value, numbers.Integral if kind is int else numbers.Real))
    if not ok:
        wanted = {bool: "True or False", str: "text", int: "an integer"}.get(kind, "a number")
        raise TypeError(f"{where} must be {wanted}, got {value!r}")


def coerce_value(kind: type, value: Any, where: str) -> Any:
    """``value`` (text from a command line, or a TOML value) as ``kind`` (bool, int, float or str); ValueError
    starting with ``where`` (e.g. "option 'mu' of strategy 'fedprox'") saying what was expected."""
    import math

    text = value.strip() if isinstance(value, str) else None
    if kind is bool:
        if isinstance(value, bool):
            return value
        if text is not None and text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if kind is str:
        return str(value)
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a number ({kind.__name__}), got {value!r}")
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(text) if text is not None else int(value)
        number = float(text if text is not None else value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{where} must be finite, got {value!r}")
    return number
