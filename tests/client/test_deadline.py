"""The client side's one deadline rule (fedpar/task.py): when a member stops training so that its upload
arrives in time, on the real clock (the runtime) and on simulated seconds (the virtual clock) alike."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fedpar.task import UPLOAD_MARGIN_SECONDS, UPLOAD_TO_DOWNLOAD, steps_in_time, stop_training_at, upload_ends_at
from fedpar.simulations.population import PopulationSlice


def test_a_member_stops_in_time_for_an_upload_longer_than_its_download():
    # a 2 s download: the upload is expected to take 2.4 s, and 0.25 s more stay free
    assert stop_training_at(10.0, 2.0) == pytest.approx(10.0 - UPLOAD_TO_DOWNLOAD * 2.0 - UPLOAD_MARGIN_SECONDS)
    assert stop_training_at(10.0, 2.0, margin_seconds=1.0) == pytest.approx(6.6)


def test_simulated_steps_are_those_that_fit_before_the_stop():
    # from the end of the download (2 s) to the stop (7.35 s): 10 steps of 0.5 s fit, not 11
    assert steps_in_time(100, 0.5, 2.0, 10.0) == 10
    assert steps_in_time(3, 0.5, 2.0, 10.0) == 3  # fewer asked than fit
    assert steps_in_time(100, 0.0, 2.0, 10.0) == 100  # steps that cost no simulated time
    assert steps_in_time(100, 0.5, 5.0, 10.0) == 0  # the download leaves no time to train


def test_the_virtual_clock_asks_the_same_rule():
    one = PopulationSlice("h", np.array([0]), None, np.zeros(1, np.float32), step_seconds=np.array([0.5], np.float32),
                          download_mbps=np.array([8.0], np.float32), upload_mbps=np.array([8.0], np.float32))
    # a 2 MB model over 8 Mbit/s: 2 s down, 2 s up
    steps, seconds = one.work(0, 100, 2_000_000, clock_seconds=0.0, deadline=10.0, dropped=False)
    assert steps == steps_in_time(100, 0.5, 2.0, 10.0) == 10 and seconds == pytest.approx(2.0 + 10 * 0.5 + 2.0)


def test_an_upload_may_run_until_the_deadline_plus_slack():
    assert upload_ends_at(time.monotonic() + 30.0) - time.monotonic() == pytest.approx(35.0, abs=0.5)
    # past the deadline: a short last try
    assert upload_ends_at(time.monotonic() - 60.0) - time.monotonic() == pytest.approx(5.0, abs=0.5)
