"""A spawned rank's failure said in one line, instead of torch's exception holding the rank's whole traceback."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from torch.multiprocessing import ProcessExitedException, ProcessRaisedException


class RankFailed(Exception):
    """A spawned rank failed by something other than the user's code: ``rank`` (its index, or "?") and ``what``
    happened to it ("failed: <the line it raised>", "was killed by SIGKILL ...", "ended with exit code 3")."""

    def __init__(self, rank: int | str, what: str, signal_name: str | None = None):
        super().__init__(f"rank {rank} {what}")
        self.rank, self.what = rank, what
        self.signal_name = signal_name  # the signal that killed it (then no traceback of its own says where)


def last_line(exc: ProcessRaisedException) -> str:
    """The last line of the rank's traceback, as torch hands it over in text: what the rank raised."""
    return ([line for line in str(exc).splitlines() if line.strip()] or [""])[-1]


def rank_failure(exc: BaseException, passes: tuple[type[Exception], ...] = ()) -> Exception:
    """What to raise for ``exc``, torch's spawn's exception: the rank's own exception when it is of a kind in
    ``passes`` (made again from its message), else RankFailed in one line (fedpar's own errors say what they are,
    so their class name is left out)."""
    if isinstance(exc, ProcessRaisedException):
        last = last_line(exc)
        for kind in passes:
            said = f"{kind.__module__}.{kind.__qualname__}: "
            if last.startswith(said):
                return kind(last[len(said):])
        name, sep, message = last.partition(": ")
        said = message if sep and name.startswith("fedpar.") else last or "no message"
        return RankFailed(exc.error_index, f"failed: {said}")
    if isinstance(exc, ProcessExitedException):
        if exc.signal_name:
            return RankFailed(exc.error_index,
                              f"was killed by {exc.signal_name} (out of memory, or stopped from outside)",
                              exc.signal_name)
        return RankFailed(exc.error_index, f"ended with exit code {exc.exit_code}")
    return RankFailed(getattr(exc, "error_index", "?"), f"failed: {type(exc).__name__}: {exc}")


@contextmanager
def ranks_said_in_one_line(debug: bool, passes: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Around a spawn of ranks: a rank's failure raised as :func:`rank_failure` says, and torch's launcher's lines
    ("Terminating process N via signal SIGTERM") kept quiet; with ``debug``, torch's exception as it is (the rank's
    traceback) and its launcher's lines."""
    launcher_log = logging.getLogger("torch.multiprocessing.spawn")
    level = launcher_log.level
    if not debug:
        launcher_log.setLevel(logging.ERROR)
    try:
        yield
    except (ProcessRaisedException, ProcessExitedException) as exc:
        if debug:
            raise
        raise rank_failure(exc, passes) from None
    finally:
        launcher_log.setLevel(level)
