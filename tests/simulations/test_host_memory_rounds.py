"""A population host's bookkeeping is bounded by a round, not by how many rounds it has run (issue 33's kind of
growth): rounds whose members score nothing (``--client-eval-every 0``, or the rounds between two scored ones) left
each of their members queued for a scoring that never came."""

from __future__ import annotations

import tracemalloc

from support.population_host import digits_population

RUNTIME = "*/client/runtime.py"


class SnapshotsAt(list):
    """The round rows (the coordinator's on_round_end), and what client/runtime.py holds when rounds ``at`` end."""

    def __init__(self, at: tuple[int, ...]):
        super().__init__()
        self.at, self.held = at, {}

    def append(self, row: dict) -> None:
        super().append(row)
        if row["round"] in self.at:
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, RUNTIME)])
            self.held[row["round"]] = sum(stat.size for stat in snapshot.statistics("filename"))


def test_a_hosts_members_of_unscored_rounds_are_not_kept_round_after_round():
    from fedpar.simulations.population import host_population

    rows = SnapshotsAt((10, 70))
    tracemalloc.start()
    try:
        with digits_population(4, rows, rounds=70, clients_per_round=4, local_epochs=1,
                               client_eval_every=0) as (worker, task):
            host = host_population(worker.server, worker.population, task, worker.partition_of, 0, seats=2,
                                   poll_seconds=1.0)
            host.run()  # until the coordinator says training is over
    finally:
        tracemalloc.stop()
    assert [r["status"] for r in rows] == ["ok"] * 70
    # 60 more rounds of 4 members: kept, each round's queue held about 60 bytes (its list and dict entry; 3.5 KB in
    # all before they were dropped), none now
    grown = rows.held[70] - rows.held[10]
    assert grown < 1_500, f"client/runtime.py holds {grown} bytes more after 60 more rounds"
