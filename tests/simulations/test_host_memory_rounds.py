"""A population host's bookkeeping is bounded by a round, not by how many rounds it has run (issue 33's kind of
growth): rounds whose members score nothing (``--client-eval-every 0``, or the rounds between two scored ones) left
each of their members queued for a scoring that never came."""

from __future__ import annotations

import tracemalloc

from support.population_host import digits_population

RUNTIME = "*/client/runtime.py"


class HeldSince(list):
    """The round rows (the coordinator's on_round_end); allocations are traced from the end of round ``start``, and
    what client/runtime.py still holds of them is noted at the end of round ``end``."""

    def __init__(self, start: int, end: int):
        super().__init__()
        self.start, self.end, self.held = start, end, None

    def append(self, row: dict) -> None:
        super().append(row)
        if row["round"] == self.start:
            tracemalloc.start()
        elif row["round"] == self.end:
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, RUNTIME)])
            self.held = sum(stat.size for stat in snapshot.statistics("filename"))
            tracemalloc.stop()


def test_a_hosts_members_of_unscored_rounds_are_not_kept_round_after_round():
    from fedpar.simulations.population import host_population

    rows = HeldSince(5, 50)
    try:
        with digits_population(4, rows, rounds=50, clients_per_round=4, local_epochs=1,
                               client_eval_every=0) as (worker, task):
            host = host_population(worker.server, worker.population, task, worker.partition_of, 0, seats=2,
                                   poll_seconds=1.0)
            host.run()  # until the coordinator says training is over
    finally:
        tracemalloc.stop()  # (a no-op unless the run ended between the two rounds)
    assert [r["status"] for r in rows] == ["ok"] * 50
    # What the host allocated over 45 rounds of 4 members and still holds: 6.6 KB when every round's queue stayed,
    # about 0.8 KB now (the open round's, and what lives for the run)
    assert rows.held < 2_500, f"client/runtime.py holds {rows.held} bytes allocated over the last 45 rounds"
