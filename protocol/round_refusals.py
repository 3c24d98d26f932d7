"""The words of an update's refusal because its round had closed: written by the coordinator (server/rounds.py),
read by a simulation host (client/host_uploads.py), which counts such an update as overselection's surplus, not a
failure. One definition, so that a rewording on one side cannot silently change what the other counts."""

from __future__ import annotations

import re

CAME_TOO_LATE = "it came too late"  # an update for a round before the current one
_CLOSED = re.compile(r"round \d+ is closed \(")


def round_closed(round_id: int, close_reason: str) -> str:
    """The refusal of an update for round ``round_id``, closed (``close_reason``) since the update began."""
    return f"round {round_id} is closed ({close_reason}); the update was not applied"


def says_round_closed(details: str) -> bool:
    """Whether a refusal's ``details`` say only that the update's round had closed (or was past)."""
    return _CLOSED.match(details) is not None or f": {CAME_TOO_LATE}" in details
