"""How often a launcher starts a lost rank's process again: at most ``per_hour`` times a rank slot in any hour; a
slot lost once more than that stays lost for the rest of the run (a rank that keeps dying is not restarted forever).
Rank 0's slot is the whole group's: when rank 0 dies, every rank is started again and rank 0 resumes from its
checkpoint."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

log = logging.getLogger("fedpar.server")
RESTARTS_PER_HOUR = 3  # replacements started for one rank slot in any hour
REPLACEMENT_ENV = "FEDPAR_REPLACES_LOST_RANK"  # set ("1") in a replacement's environment by its launcher
NAMESPACE_ENV = "FEDPAR_RANKS_NAMESPACE"  # the run's keys in the rendezvous store, given every rank by its launcher
LEFT_OUT_EXIT = 75  # what a rank that rank 0 went on without exits with under fedpar's launcher (EX_TEMPFAIL)


def left_out_exit_code() -> int:
    """What a rank that rank 0 left out (it hung, woke and found the group gone on without it) exits with: under
    fedpar's own launcher (parallel/init.spawn, which names the namespace) LEFT_OUT_EXIT, on which it starts a
    replacement; under another launcher 0 (torchrun ends every rank when one fails)."""
    return LEFT_OUT_EXIT if NAMESPACE_ENV in os.environ else 0


class RestartBudget:
    """Each rank slot's restarts in the last hour, and the slots given up."""

    def __init__(self, per_hour: int = RESTARTS_PER_HOUR, clock: Callable[[], float] = time.monotonic):
        self.per_hour, self.clock = per_hour, clock
        self.started: dict[int, list[float]] = {}
        self.given_up: set[int] = set()

    def allow(self, rank: int, cause: str = "") -> bool:
        """Whether lost rank ``rank`` (rank 0: the whole group, which died of ``cause``) may be started again now; one
        log line the first time either way."""
        if rank in self.given_up:
            return False
        now = self.clock()
        recent = self.started[rank] = [t for t in self.started.get(rank, []) if now - t < 3600.0]
        if len(recent) >= self.per_hour:
            self.given_up.add(rank)
            log.warning("aggregator ranks: rank %d was restarted %d times within the hour; going on without it",
                        rank, self.per_hour)
            return False
        recent.append(now)
        if rank == 0:
            log.warning("aggregator ranks: rank 0 died (%s); starting every rank again (restart %d of at most %d an "
                        "hour): rank 0 resumes after the last checkpointed round", cause, len(recent), self.per_hour)
        else:
            log.warning("aggregator ranks: starting a new process for rank %d (restart %d of at most %d an hour); it "
                        "is taken back when a round opens once it is ready", rank, len(recent), self.per_hour)
        return True
