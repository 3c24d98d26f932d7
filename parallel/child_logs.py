"""How a spawned process (a simulation worker, an aggregator rank) logs: fedpar's lines at its parent's level, in
the command's format."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(name)s %(message)s"


def log_like_parent(level: int) -> None:
    """fedpar's loggers at ``level`` (the parent's, e.g. simulate --log-level); other libraries' warnings still show."""
    logging.basicConfig(level=min(level, logging.WARNING), format=FORMAT)
    logging.getLogger("fedpar").setLevel(level)
