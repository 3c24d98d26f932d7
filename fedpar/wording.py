"""How fedpar's lines say a count of things."""

from __future__ import annotations


def counted(count: int, noun: str) -> str:
    """'1 agent', '2 agents': ``count`` and ``noun``, plural unless it is one."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
