"""When a member must stop training and upload: the client side's one deadline rule.

A member expects its upload to take UPLOAD_TO_DOWNLOAD times what the round's download took, and keeps
UPLOAD_MARGIN_SECONDS more free before the task's deadline; its upload call may run until the deadline plus slack
for the reply. The client runtime (client/runtime.py) asks it on the
real clock; a simulation's virtual clock (simulations/population.py) asks it on simulated seconds.
"""

from __future__ import annotations

import time

UPLOAD_TO_DOWNLOAD = 1.2  # a member expects its upload to take this many times its download
UPLOAD_MARGIN_SECONDS = 0.25  # ... and keeps this much more free before the deadline


def stop_training_at(deadline_at: float, download_seconds: float,
                     margin_seconds: float = UPLOAD_MARGIN_SECONDS) -> float:
    """The time (on the deadline's clock) by which training must end for the upload to arrive in time."""
    return deadline_at - UPLOAD_TO_DOWNLOAD * download_seconds - margin_seconds


def steps_in_time(steps: int, step_seconds: float, download_seconds: float, deadline_seconds: float) -> int:
    """How many of ``steps`` local steps of ``step_seconds`` each fit between a download of ``download_seconds``
    (started at 0) and the moment :func:`stop_training_at` says training must end, ``deadline_seconds`` after 0."""
    if step_seconds <= 0:
        return steps
    room = stop_training_at(deadline_seconds, download_seconds) - download_seconds
    return min(steps, int(max(0.0, room) // step_seconds))


def upload_timeout(deadline_at: float) -> float:
    """How long an upload call may take: until the round's deadline, plus slack for the reply (at least 5 s)."""
    return max(5.0, deadline_at - time.monotonic() + 5.0)
