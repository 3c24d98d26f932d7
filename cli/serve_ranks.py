"""Aggregator ranks under the long-lived service (``fedpar serve --state PATH --aggregator-ranks N``).

Rank 0 runs the service; each run it executes gets a leader of its own (:class:`RunRankLeader`), which, once the
run's checkpoint is restored, announces the run's options to the other ranks through the rendezvous store the ranks
met at (no collective is open between runs, so none can time out). Each other rank (:func:`follow_runs`) waits for
the next announcement, builds that run's parts and serves its share of the run's uploads until rank 0 ends the run,
then waits for the next one. The group, and the ranks it lost, carry over from run to run.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from typing import Callable

from fedpar.cli.run_settings import run_args
from fedpar.server.ranks.group import RankGroup
from fedpar.server.ranks.leader import RankLeader

RUN_KEY = "fedpar/service/run"  # + /N: the options of the N-th run rank 0 executes
LATEST_KEY = "fedpar/service/latest"  # the N of the run rank 0 announced last (a replacement rank joins that run)
WAIT_SECONDS = 60.0  # one wait for the next run (then another: a service may idle for weeks)


class RunRankLeader(RankLeader):
    """The leader of one run of a service: announces the run when it starts, and ends the other ranks' part of it
    however the run ends (finished, failed, stopped by an operator), so that they are ready for the next run; when a
    signal stops the service, as a run stopped early (the launcher then stops every rank)."""

    def __init__(self, ranks: ServiceRanks, options: dict, tls):
        super().__init__(ranks.group, ranks.advertised, tls)
        self.ranks, self.options = ranks, options

    async def start(self, coordinator) -> None:
        """Tell the other ranks which run to serve, then start it with them."""
        self.ranks.announce(self.options)
        await super().start(coordinator)

    async def stop(self, finished: bool) -> None:
        """Stop this run on every rank (once only, and not waiting for lost ranks, when the service is stopping)."""
        await super().stop(finished or not self.ranks.signalled())


class ServiceRanks:
    """Rank 0's side of a service's aggregator ranks: a leader for each run."""

    def __init__(self, group: RankGroup, advertised: str):
        self.group, self.advertised = group, advertised
        self.announced = 0
        self.signalled: Callable[[], bool] = lambda: False  # whether a signal is stopping the service (set by it)

    def leader_for(self, options: dict, plan) -> RunRankLeader:
        """The leader of the run of ``options`` (its settings, out and checkpoint folder; JSON-ready)."""
        return RunRankLeader(self, options, plan.security.files)

    def announce(self, options: dict) -> None:
        """The next run's options to the other ranks."""
        self.announced += 1
        self.group.run = self.announced
        self.group.store.set(f"{RUN_KEY}/{self.announced}", json.dumps(options))
        self.group.store.set(LATEST_KEY, str(self.announced))


def follow_runs(args: argparse.Namespace, group: RankGroup, serve_run: Callable[[argparse.Namespace], int]) -> int:
    """Ranks > 0: ``serve_run(options)`` for each run rank 0 announces, in order, until rank 0 is gone (0) or a run
    left this rank out (what ``serve_run`` returned then). The replacement of a lost rank starts at the run in
    progress (or the next one), and asks again in each run until rank 0 takes it back."""
    followed = runs_before_mine(group) if group.replacing else 0
    while True:
        key = f"{RUN_KEY}/{followed + 1}"
        try:
            group.store.wait([key], timedelta(seconds=WAIT_SECONDS))
        except RuntimeError as exc:  # DistStoreError: the wait ran out, or rank 0 (which holds the store) is gone
            if "timeout" in str(exc).lower():
                continue
            return 0
        followed += 1
        group.run = followed
        code = serve_run(run_args(args, json.loads(group.store.get(key))))
        if code:
            return code
        if group.control is None and not group.replacing:  # rank 0 went on without this rank (torchrun's exit 0)
            return 0


def runs_before_mine(group: RankGroup) -> int:
    """How many of the service's runs a replacement rank starting now skips: those rank 0 is done with."""
    try:
        latest = int(group.store.get(LATEST_KEY)) if group.store.check([LATEST_KEY]) else 0
        return latest if latest and group.run_stopped(latest) else max(latest - 1, 0)
    except RuntimeError:  # rank 0 and its store are gone: the wait for the next run says so
        return 0
