"""The restart limit of a lost rank's slot (parallel/restarts.py): at most 3 restarts a slot in any hour; the 4th
loss in the hour leaves the slot lost, said in one line. With an injected clock, and with real rank processes."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from fedpar.parallel.init import spawn
from fedpar.parallel.restarts import REPLACEMENT_ENV, RestartBudget


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_the_4th_loss_of_a_slot_within_the_hour_leaves_it_lost_with_one_line(caplog):
    clock = Clock()
    caplog.set_level(logging.WARNING, logger="fedpar.server")
    budget = RestartBudget(clock=clock)
    for _ in range(3):  # three losses over 59 minutes: each slot restarted
        assert budget.allow(1)
        clock.now += 59 * 60 / 3
    assert budget.allow(2)  # another slot has a budget of its own
    assert not budget.allow(1)  # the 4th within the hour
    assert not budget.allow(1)  # and from then on, without another line
    clock.now += 10 * 3600
    assert not budget.allow(1)  # a slot given up stays lost for the rest of the run
    assert _lines(caplog, "rank 1 was restarted 3 times within the hour; going on without it") == [
        "aggregator ranks: rank 1 was restarted 3 times within the hour; going on without it"]
    assert len(_lines(caplog, "starting a new process for rank 1")) == 3
    assert "restart 3 of at most 3 an hour" in _lines(caplog, "starting a new process for rank 1")[-1]


def test_restarts_older_than_an_hour_no_longer_count(caplog):
    clock = Clock()
    caplog.set_level(logging.WARNING, logger="fedpar.server")
    budget = RestartBudget(clock=clock)
    for _ in range(3):
        assert budget.allow(1)
        clock.now += 1300.0  # 3 900 s for the three: the first is more than an hour old at the 4th
    assert budget.allow(1)
    assert "restart 3 of at most 3 an hour" in _lines(caplog, "starting a new process for rank 1")[-1]
    assert not _lines(caplog, "going on without it")


def _rank_1_dies(folder: str) -> None:
    """Rank 1 (and each replacement) notes its pid and dies at once; rank 0 leaves once the last rank 1 it expects
    is gone and the launcher has seen it (reaped it: it then weighs a restart at once, while rank 0 is alive)."""
    note = Path(folder, "rank1")
    if os.environ["RANK"] == "1":
        with note.open("a") as f:
            f.write(f"{os.getpid()} {os.environ.get(REPLACEMENT_ENV, '0')}\n")
        os._exit(3)
    end = time.monotonic() + 60
    while time.monotonic() < end and len(note.read_text().splitlines() if note.exists() else []) < 2:
        time.sleep(0.05)
    last = note.read_text().splitlines()[-1].split()[0]
    while time.monotonic() < end and Path(f"/proc/{last}").exists():  # a zombie until the launcher reaps it
        time.sleep(0.05)
    time.sleep(0.5)


def test_a_launch_leaves_a_slot_lost_once_its_restarts_are_spent(tmp_path, caplog):
    """Real ranks under spawn(), with a budget of one restart an hour: rank 1 dies, a replacement is started and dies
    too; that slot is then left lost in one line, and rank 0 ends the launch by itself."""
    caplog.set_level(logging.WARNING, logger="fedpar.server")
    spawn(2, _rank_1_dies, str(tmp_path), parent_stops=True, rank_0_decides=True, start_method="fork",
          restarts=RestartBudget(per_hour=1))
    started = [line.split() for line in (tmp_path / "rank1").read_text().splitlines()]
    assert [flag for _, flag in started] == ["0", "1"]  # the first rank 1, then one replacement, no more
    assert len(_lines(caplog, "starting a new process for rank 1 (restart 1 of at most 1 an hour)")) == 1
    assert _lines(caplog, "going on without it") == [
        "aggregator ranks: rank 1 was restarted 1 times within the hour; going on without it"]
