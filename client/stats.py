"""What a client runtime's members did over its life: the counts the runtime keeps (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AgentStats:
    """What an agent did over its life."""

    refusals: list[str] = field(default_factory=list)  # what was refused, and why
    tasks: int = 0
    accepted: int = 0
    refused: int = 0
    dropped: int = 0
    reconnects: int = 0
