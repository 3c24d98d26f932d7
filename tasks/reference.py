"""A task named on the command line: ``--task package.module:factory`` or ``--task path/to/file.py:factory``, called
with the ``--task-option KEY=VALUE`` pairs.

The factory's options are declared once, torchtitan style, as a dataclass: ``def task(options: MyOptions) -> Task``
gets a ``MyOptions`` built from the pairs, each value typed as its field (bool, int, float, str, Path, a Literal or
an Enum of choices, or ``X | None`` of those, where ``none`` gives None; another declared type takes only a TOML
value of a --config file). A factory with plain keyword parameters gets them typed by annotation (or by default
value), one with ``**options`` any other option as given. The reference may also name a Task itself (then it takes
no options). Mistakes are one-line :class:`TaskError`\\ s.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpar.models.references import load_reference, split_reference
from fedpar.settings import SIMPLE_TYPES, coerce_value
from fedpar.task import TASK_CODE_ERRORS, Task, TaskError, raised


def load_task(ref: str, options: Mapping[str, Any] | None = None, check: bool = True) -> Task:
    """The Task ``ref`` makes with ``options`` (text or TOML values), checked (unless ``check`` is False: a process
    whose launcher checked the same task); TaskError saying what is wrong."""
    options = dict(options or {})
    try:
        target = load_reference(ref, "task factory")
    except ValueError as exc:
        raise TaskError(f"--task: {exc}") from None
    if isinstance(target, Task):
        if options:
            raise TaskError(f"--task {ref} is a Task, not a factory: it takes no --task-option "
                            f"(got {', '.join(sorted(options))})")
        task = target
    elif isinstance(target, type) and issubclass(target, Task):
        raise TaskError(f"--task {ref} is the class {target.__name__}, a kind of fedpar.Task, not a Task: name a "
                        f"function returning one (def task(): return {target.__name__}(model=..., client_data=..., "
                        "...)), or a Task made in the file")
    elif callable(target):
        arguments, options = factory_arguments(ref, target, options)
        try:
            task = target(**arguments)
        except TaskError:
            raise
        except TASK_CODE_ERRORS as exc:  # the task's own code: one line, as a file that fails to run is said
            raise TaskError(f"--task {ref}: {_option_of(exc, options)}the factory raised {raised(exc)}") from exc
    else:
        raise TaskError(f"--task {ref} is a {type(target).__name__}; it must name a function returning a fedpar.Task")
    if not isinstance(task, Task):
        raise TaskError(f"--task {ref} returned a {type(task).__name__}, not a fedpar.Task")
    if task.name == "task":
        task = dataclasses.replace(task, name=ref)
    if not task.description:
        task.description = {"task": from_anywhere(ref),
                            "task_options": {k: _recorded(_anchored(v)) for k, v in options.items()}}
    if check:
        task.check()
    return task


def _option_of(exc: Exception, options: Mapping[str, Any]) -> str:
    """'--task-option KEY=VALUE: ' for the option naming the file the factory could not open (``exc``, an OSError
    that names its value), else ''."""
    if isinstance(exc, OSError):
        said = f"{exc.filename or ''} {exc}"
        for key, value in options.items():
            if isinstance(value, (str, Path)) and str(value) and str(value) in said:
                return f"--task-option {key}={value}: "
    return ""


def from_anywhere(ref: str) -> str:
    """``ref`` as global.json and checkpoints keep it: a file's path made absolute (it is loaded again from other
    folders, or named otherwise by the same user); a task's own name, not a reference, as it is."""
    try:
        where, name = split_reference(ref)
    except ValueError:
        return ref
    return f"{Path(where).expanduser().resolve()}:{name}" if where.endswith(".py") else ref


def factory_arguments(ref: str, factory: Any, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword arguments of ``factory`` that ``options`` give (one dataclass argument built from all of them,
    or typed keyword arguments), and ``options`` typed as the factory declares them, by field or parameter name."""
    try:
        params = inspect.signature(factory).parameters
        hints = typing.get_type_hints(factory)
    except (TypeError, ValueError, NameError) as exc:
        raise TaskError(f"--task {ref}: cannot read the factory's parameters ({exc})") from None
    declared = [(name, hints.get(name)) for name in params if dataclasses.is_dataclass(hints.get(name))]
    if len(params) == 1 and declared:
        name, cls = declared[0]
        typed = _typed_options(ref, options, _dataclass_options(cls))
        try:
            return {name: cls(**typed)}, typed
        except (TypeError, ValueError) as exc:  # the dataclass's own checks (__post_init__)
            raise TaskError(f"--task {ref}: {exc}") from None
    named = {name: p.default for name, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    accepted = {n: (_text_type(hints.get(n), d), d, _allows_none(hints.get(n))) for n, d in named.items()}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):  # **options: any other option, as given
        accepted.update({key.strip().replace("-", "_"): (None, None, False) for key in options
                         if key.strip().replace("-", "_") not in accepted})
    typed = _typed_options(ref, options, accepted)
    return typed, typed


def _dataclass_options(cls: type) -> dict[str, tuple[type | None, Any, bool]]:
    """The options dataclass ``cls`` declares: field name -> (type a text value becomes, default, whether it may be
    None)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (_text_type(hints.get(f.name), f.default), _default(f), _allows_none(hints.get(f.name)))
            for f in dataclasses.fields(cls) if f.init}


def _typed_options(ref: str, options: dict[str, Any], accepted: dict[str, tuple[Any, Any, bool]]) -> dict[str, Any]:
    """``options`` typed by ``accepted`` (name -> (type, default; inspect.Parameter.empty when required, whether it
    may be None)); TaskError for an unknown option or a missing required one, naming the valid ones."""
    valid = _describe(accepted)
    values = {}
    for key, value in options.items():
        name = key.strip().replace("-", "_")
        if name not in accepted:
            raise TaskError(f"--task {ref} has no option {key!r}; {valid}")
        kind, _, nullable = accepted[name]
        none = _means_none(value) and str(value).strip() not in (_choices(kind) or {})  # a choice 'none' is itself
        values[name] = None if nullable and none else _typed(ref, name, kind, value, none)
    missing = [n for n, (_, default, _) in accepted.items() if default is inspect.Parameter.empty and n not in values]
    if missing:
        raise TaskError(f"--task {ref} needs --task-option {missing[0]}=...; {valid}")
    return values


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return inspect.Parameter.empty


def _text_type(hint: Any, default: Any) -> Any:
    """The type a text value of this option becomes: bool, int, float, str, Path, a Literal or an Enum, another
    declared type (which text cannot give), or None (undeclared: passed as given)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None  # int | str: which one text means is not said, so as given
    if hint is None and default is not None and type(default) in SIMPLE_TYPES:
        return type(default)
    return None if hint in (None, Any, object) else hint


def _allows_none(hint: Any) -> bool:
    """Whether an option declared ``hint`` may be None (``X | None``, ``Optional[X]``): ``none`` then gives None."""
    return (isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union) and \
        type(None) in typing.get_args(hint)


def _means_none(value: Any) -> bool:
    """Whether a given value says None: ``none`` (any case) as text, or a null kept in global.json."""
    return value is None or (isinstance(value, str) and value.strip().lower() == "none")


def _anchored(value: Any) -> Any:
    """An option as global.json keeps it: a relative path naming a file or folder here (one with a folder or a
    suffix, 'examples/table.csv', not a word such as 'digits') made absolute, as the task's file is, so the task is
    rebuilt the same from any folder."""
    if isinstance(value, (str, Path)) and str(value):
        path = Path(value)
        if not path.is_absolute() and (len(path.parts) > 1 or path.suffix) and path.exists():
            return str(path.resolve())
    return value


def _recorded(value: Any) -> Any:
    """A typed option as global.json keeps it: numbers and booleans as such, a Path as its text."""
    if isinstance(value, enum.Enum):  # by its value, which the option takes back
        value = value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_recorded(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _recorded(v) for k, v in value.items()}
    return str(value)


def _choices(kind: Any) -> dict[str, Any] | None:
    """A Literal's or an Enum's choices by the text that names each (an Enum member by value or name); else None."""
    if typing.get_origin(kind) is typing.Literal:
        return {str(c): c for c in typing.get_args(kind)}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return {**{str(m.value): m for m in kind}, **{m.name: m for m in kind}}
    return None


def _typed(ref: str, name: str, kind: Any, value: Any, none: bool = False) -> Any:
    """``value`` as option ``name``'s ``kind``; ``none``: it says None, which this option's type does not allow."""
    where = f"--task {ref}: option {name!r}"
    if none and kind not in (None, str):  # said before its type's own complaint ('must be an integer')
        raise TaskError(f"{where} cannot be none: it is declared {_type_name(kind)}, not {_type_name(kind)} | None; "
                        "give a value, or leave the option out for its default")
    if kind is None:
        return value
    if kind is Path:
        return Path(str(value))
    choices = _choices(kind)
    if choices is not None:
        if str(value).strip() not in choices:
            raise TaskError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
        return choices[str(value).strip()]
    if kind not in SIMPLE_TYPES:  # list[int], a class of the task's own: text cannot say which
        if not isinstance(value, str):
            return value  # a TOML value of a --config file's task_options table
        raise TaskError(f"{where} is declared {_type_name(kind)}, which a --task-option's text cannot give: set it in "
                        "a --config file's task_options table, or declare it str and parse it in the factory")
    try:
        return coerce_value(kind, value, where)
    except ValueError as exc:
        raise TaskError(str(exc)) from None


def _type_name(kind: Any) -> str:
    return "any" if kind is None else kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")


def _describe(options: dict[str, tuple[Any, Any]]) -> str:
    if not options:
        return "it takes no options"
    parts = [f"{name} ({_type_name(kind)}{' or none' if nullable else ''}"
             f"{'' if default is inspect.Parameter.empty else f', default {default!r}'})"
             for name, (kind, default, nullable) in options.items()]
    return "its options: " + "; ".join(parts)
