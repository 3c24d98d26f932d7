"""What a mistyped name most likely meant: one "did you mean" for every message that offers one. This module
depends on nothing: every room may use it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, choices: Iterable[str], cutoff: float = 0.75) -> str | None:
    """The one of ``choices`` that ``word`` most likely misspells (similarity at least ``cutoff``), else None."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return found[0] if found else None


def did_you_mean(words: Iterable[str | None]) -> str:
    """`` (did you mean A, B?)`` naming ``words`` (None left out, e.g. what :func:`closest` found nothing for) once
    each, in order; empty when there are none."""
    words = list(dict.fromkeys(w for w in words if w))
    return f" (did you mean {', '.join(words)}?)" if words else ""
