"""What each aggregator rank took in a round, as the metrics row's and the progress table's per-rank columns."""

from __future__ import annotations

import resource

from fedpar.server.rounds import RoundState

# per-rank ingest columns of the metrics row: uploads, their bytes, fold seconds, folds (each a group of the updates
# that waited: server/round_modes.py FoldQueue) and the most updates one took, peak memory
STAT_NAMES = ("uploads", "bytes", "fold_s", "fold_groups", "fold_group_max", "peak_mib")


def rank_columns(world: int) -> list[tuple[str, str]]:
    """The progress table's per-rank ingest columns (uploads and fold seconds) for ``world`` ranks."""
    return [col for r in range(world) for col in ((f"r{r}_uploads", "{:>10.0f}"), (f"r{r}_fold_s", "{:>9.3f}"))]


def ingest_stats(state: RoundState, rank: int) -> list[float]:
    """What ``rank`` took in this round (the columns of STAT_NAMES): accepted uploads, their bytes, seconds spent
    folding, the folds and the most updates one took, and the process's peak resident memory so far in MiB."""
    mine = [s for s in state.slots.values() if s.rank == rank and s.status == "accepted"]
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return [float(len(mine)), float(sum(s.upload_bytes for s in mine)), state.fold_seconds, float(state.fold_groups),
            float(state.fold_group_max), peak_mib]
