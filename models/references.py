"""User code named on the command line: ``package.module:name`` or ``path/to/file.py:name``.

One loader for every option that takes a reference (``--strategy flower:...``, ``client --flower-client``).
A path is recognised by its ``.py`` ending; it is run as a module of its own (its folder is not put on
``sys.path``). Errors are one-line ValueErrors naming the reference and what is wrong.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def split_reference(ref: str) -> tuple[str, str]:
    """``(module or file, attribute)`` of ``ref``; ValueError unless it reads ``MODULE:NAME`` or ``FILE.py:NAME``."""
    where, sep, name = ref.strip().rpartition(":")
    if not sep or not where or ":" in where or not name.isidentifier():  # one colon: a module's name has none
        raise ValueError(f"{ref!r} is not a reference: write package.module:name or path/to/file.py:name")
    return where, name


def load_reference(ref: str, what: str = "object") -> Any:
    """The object ``ref`` names (``what`` says what it should be, for the error messages)."""
    where, name = split_reference(ref)
    module = _load_file(where, ref) if where.endswith(".py") else _import(where, ref)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{where} has no {what} called {name!r} (from {ref!r})") from None


def _import(module: str, ref: str):
    """``import module``, its failure said in one line."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"cannot import {module!r} (from {ref!r}): {exc}") from None
    except (Exception, SystemExit) as exc:  # its own code failed as it ran (a SyntaxError, what it raised, its exit)
        raise ValueError(f"importing {module!r} (from {ref!r}) failed: {type(exc).__name__}: {exc}"
                         f"{_exit_hint(exc)}") from None


def _load_file(path: str, ref: str):
    """Run ``path`` as a fresh module (named after its resolved path, so two files never share a module)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"no such file: {path} (from {ref!r})")
    unique = "fedpar_user_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    if unique in sys.modules:
        return sys.modules[unique]
    spec = importlib.util.spec_from_file_location(unique, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique] = module  # dataclasses and typing resolve names through sys.modules
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a script's argparse, say, reading fedpar's command line
        del sys.modules[unique]
        raise ValueError(f"running {path} failed: {type(exc).__name__}: {exc}{_sibling_hint(exc, file)}") from None
    return module


def _exit_hint(exc: BaseException) -> str:
    """How to keep a script's part from running as it is loaded, when ``exc`` is its exit; else ''."""
    if not isinstance(exc, SystemExit):
        return ""
    return (" (it exited as it was loaded: a file fedpar loads must not parse the command line or exit when imported; "
            "put its script part under if __name__ == '__main__':)")


def _sibling_hint(exc: BaseException, file: Path) -> str:
    """How to import a module that lies beside ``file`` (its folder is not on sys.path), when ``exc`` failed to; how
    to keep a script's part from running as it is loaded, when ``exc`` is its exit."""
    if isinstance(exc, SystemExit):
        return _exit_hint(exc)
    top = (getattr(exc, "name", None) or "").partition(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or not top:
        return ""
    if not ((file.parent / f"{top}.py").is_file() or (file.parent / top / "__init__.py").is_file()):
        return ""
    return f" ({top} lies beside it, but its folder is not on sys.path: run with PYTHONPATH={file.parent})"
