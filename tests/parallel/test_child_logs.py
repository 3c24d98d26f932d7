"""The library lines a fedpar command keeps out of the user's way (parallel/child_logs.quiet_libraries)."""

from __future__ import annotations

import logging

from fedpar.parallel.child_logs import quiet_libraries


def _record(message: str, error: BaseException | None) -> logging.LogRecord:
    exc_info = (type(error), error, None) if error is not None else None
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, exc_info)


def test_grpc_s_poll_for_a_closed_event_loop_is_not_said_and_other_asyncio_errors_are():
    # CI: "Exception in callback PollerCompletionQueue._handle_events(...)" with a RuntimeError traceback, printed as a
    # Flower App simulation's coordinator closed its event loop
    quiet_libraries(logging.INFO)
    loops = logging.getLogger("asyncio")
    closed = RuntimeError("Event loop is closed")
    assert not loops.filter(_record("Exception in callback PollerCompletionQueue._handle_events(<_UnixSelector>)()",
                                    closed))
    assert loops.filter(_record("Exception in callback Task.__step()", closed))
    assert loops.filter(_record("Exception in callback PollerCompletionQueue._handle_events()", ValueError("other")))
    quiet_libraries(logging.INFO)  # twice: one filter
    assert sum(type(f).__name__ == "_PollsForAClosedLoop" for f in loops.filters) == 1
