"""How a spawned process (a simulation worker, an aggregator rank) logs: fedpar's lines at its parent's level, in
the command's format."""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s %(name)s %(message)s"


def log_like_parent(level: int) -> None:
    """fedpar's loggers at ``level`` (the parent's, e.g. simulate --log-level); other libraries' warnings still show."""
    logging.basicConfig(level=min(level, logging.WARNING), format=FORMAT)
    logging.getLogger("fedpar").setLevel(level)
    quiet_libraries(level)


def own_standard_streams(launcher: LauncherSide | None = None) -> None:
    """sys.stdout and sys.stderr write to this process's file descriptors 1 and 2, as in a spawned process: a forked
    one holds its parent's, which may be a redirection (contextlib.redirect_stdout) whose copy here nobody reads.
    ``launcher``: what a child of a fork server takes from the process that started it (its descriptors 1 and 2,
    its environment), first."""
    if launcher is not None:
        launcher.adopt()
    if sys.__stdout__ is not None:
        sys.stdout = sys.__stdout__
    if sys.__stderr__ is not None:
        sys.stderr = sys.__stderr__


class LauncherSide:
    """What a child started by a fork server (parallel/init.py rank_start_method) takes from the process that started
    it, as a spawned child has them: its file descriptors 1 and 2 and its environment as they are now. The server's
    are this process's of the moment the server started (a test's captured output, since gone, say)."""

    def __init__(self):
        self.env = dict(os.environ)
        self.streams: tuple | None = None

    def __getstate__(self) -> dict:
        from multiprocessing import reduction

        streams = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:  # closed here: the child keeps the server's
                streams.append(None)
                continue
            streams.append(reduction.DupFd(fd))  # handed over with the child's start (pickled by its Popen only)
        return {"env": self.env, "streams": tuple(streams)}

    def adopt(self) -> None:
        """In the child: the launcher's descriptors 1 and 2 and its environment."""
        for fd, handed in zip((1, 2), self.streams or ()):
            if handed is not None:
                held = handed.detach()
                os.dup2(held, fd)
                os.close(held)
        os.environ.clear()
        os.environ.update(self.env)


def launcher_side(start_method: str) -> LauncherSide | None:
    """What a child started by ``start_method`` must be handed to write and run where a spawned one would: only a
    fork server's child needs it (a forked or spawned one inherits both)."""
    return LauncherSide() if start_method == "forkserver" else None


def quiet_libraries(level: int) -> None:
    """torch's and gRPC's Python INFO lines are not the user's: only their warnings show (gRPC's all of them at
    ``level`` debug). torch's exit hook printed 'FakeTensor cache stats' after a Ctrl-C's 'interrupted'; an
    aggregator rank's server stopping with a host's upload stream open said 'Aborting method [...HostUploadStream]
    due to server stop.'; and asyncio printed a traceback (once in a CI run, for a Flower App simulation that ended at
    once) when gRPC's poller handed a last event to the coordinator's event loop as that loop closed."""
    logging.getLogger("torch").setLevel(max(logging.WARNING, level))
    logging.getLogger("grpc").setLevel(logging.DEBUG if level <= logging.DEBUG else max(logging.WARNING, level))
    cygrpc = logging.getLogger("grpc._cython.cygrpc")
    if level > logging.DEBUG and not any(isinstance(f, _ServerStopAborts) for f in cygrpc.filters):
        cygrpc.addFilter(_ServerStopAborts())
    loops = logging.getLogger("asyncio")
    if level > logging.DEBUG and not any(isinstance(f, _PollsForAClosedLoop) for f in loops.filters):
        loops.addFilter(_PollsForAClosedLoop())


class _ServerStopAborts(logging.Filter):
    """Drops gRPC's line for a stream a stopping server cut (a rank's, at a run's end): expected, and not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "due to server stop" not in record.getMessage()


class _PollsForAClosedLoop(logging.Filter):
    """Drops asyncio's report of gRPC's aio poller (one per process) handing an event to an event loop that has closed
    (the coordinator's, at the end of its run): nothing was waiting for it, and it is not an error of the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not ("PollerCompletionQueue._handle_events" in record.getMessage() and isinstance(error, RuntimeError)
                    and "Event loop is closed" in str(error))
