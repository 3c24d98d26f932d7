"""A stop signal that comes while the main thread runs the logging module's own code is raised once it has left it:
raised between a lock's acquire and its ``try``, StopRequested left logging's lock held by the main thread, and every
other thread that logged waited for ever (a coordinator stopped as it started: its port's thread, starting its event
loop, logged and waited; the launcher waited out its 60 s grace and killed it, QA 1 in about 50)."""

from __future__ import annotations

import logging
import signal
import sys
import time

import pytest

from fedpar.parallel.stopping import StopRequested, stop_on_signals

# The signal comes while code of logging's own file runs (as the profiler and the handler's frame see it)
IN_LOGGING = compile("signal.raise_signal(signal.SIGTERM)\nstate['after_the_signal'] = True\n", logging.__file__,
                     "exec")


def test_a_stop_that_comes_in_logging_is_raised_once_the_main_thread_left_it():
    state: dict = {}
    with pytest.raises(StopRequested) as stopped:
        with stop_on_signals():
            exec(IN_LOGGING, {"signal": signal, "state": state})
            state["left_logging"] = time.monotonic()
            end = time.monotonic() + 10
            while time.monotonic() < end:  # the stop comes here, out of logging
                time.sleep(0.01)
    assert state.get("after_the_signal") and "left_logging" in state, state
    assert stopped.value.signum == signal.SIGTERM


def test_a_stop_elsewhere_is_raised_where_it_comes():
    state: dict = {}
    with pytest.raises(StopRequested):
        with stop_on_signals():
            exec(compile("signal.raise_signal(signal.SIGTERM)\nstate['after_the_signal'] = True\n", __file__,
                         "exec"), {"signal": signal, "state": state})
    assert "after_the_signal" not in state and sys.exc_info() == (None, None, None)
