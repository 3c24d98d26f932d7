"""What a run's rounds came to (summary.json's figures), kept as running figures: rows are taken one at a time and
nothing per round is held, so a run of a million rounds summarizes in the memory of one."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

_LAST_KEYS = ("test_accuracy", "dp_epsilon", "sim_seconds")  # what the summary reads from the last row


@dataclass
class RunningSummary:
    """Accuracy, rounds and failed rounds, mean round seconds and upload bytes, the privacy budget spent, simulated
    seconds under a virtual clock, and the time to ``target_accuracy`` if given, from the rows taken so far."""

    target_accuracy: float | None = None
    rounds: int = 0
    failed_rounds: int = 0
    round_seconds_sum: float = 0  # summed in row order from 0, as sum() does: the means come out the same
    upload_bytes_sum: float = 0
    best_test_accuracy: float | None = None
    last: dict = field(default_factory=dict)  # the last row's entries of _LAST_KEYS that it has
    hit: dict | None = None  # round, wall_seconds (and sim_seconds) of the first row at the target accuracy

    def add(self, row: dict) -> None:
        """Take the next round's (cleaned) metrics row."""
        accuracy = row.get("test_accuracy") or 0.0
        self.rounds += 1
        self.failed_rounds += row.get("status") != "ok"
        self.round_seconds_sum = self.round_seconds_sum + (row.get("round_seconds") or 0)  # a row without: 0
        self.upload_bytes_sum = self.upload_bytes_sum + (row.get("upload_bytes") or 0)
        if self.best_test_accuracy is None or accuracy > self.best_test_accuracy:
            self.best_test_accuracy = accuracy
        self.last = {k: row[k] for k in _LAST_KEYS if k in row}
        if self.hit is None and self.target_accuracy is not None and accuracy >= self.target_accuracy:
            self.hit = {"round": row.get("round"), "wall_seconds": row.get("wall_seconds"),
                        "sim_seconds": row.get("sim_seconds")}

    def result(self) -> dict:
        """summary.json's figures (``simulate``'s and ``serve``'s), in its order."""
        n = self.rounds
        out = {"final_test_accuracy": self.last.get("test_accuracy") if n else None,
               "best_test_accuracy": self.best_test_accuracy,
               "rounds": n,
               "failed_rounds": self.failed_rounds,
               "mean_round_seconds": self.round_seconds_sum / n if n else None,
               "mean_upload_bytes_per_round": self.upload_bytes_sum / n if n else None}
        if "dp_epsilon" in self.last:
            out["final_dp_epsilon"] = self.last["dp_epsilon"]
        if "sim_seconds" in self.last:
            out["sim_seconds"] = self.last["sim_seconds"]
        if self.target_accuracy is not None:
            hit = self.hit
            out.update(target_accuracy=self.target_accuracy, rounds_to_target=hit["round"] if hit else None,
                       wall_seconds_to_target=hit["wall_seconds"] if hit else None)
            if "sim_seconds" in self.last:
                out["sim_seconds_to_target"] = hit["sim_seconds"] if hit else None
        return out

    def copy(self) -> RunningSummary:
        """An independent copy (to count a row for a checkpoint before the log takes it)."""
        return RunningSummary(**{**asdict(self), "last": dict(self.last),
                                 "hit": dict(self.hit) if self.hit else None})

    def state(self) -> dict:
        """JSON-able state (a checkpoint's ``metrics_summary``)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> RunningSummary:
        """The summary :meth:`state` saved; ValueError when it is not one."""
        if not isinstance(state, dict) or set(state) != {f.name for f in fields(cls)}:
            raise ValueError(f"not a running summary: {state!r:.200}")
        numbers = [state[k] for k in ("rounds", "failed_rounds", "round_seconds_sum", "upload_bytes_sum")]
        optional = [state[k] for k in ("target_accuracy", "best_test_accuracy")]
        if not all(_number(v) for v in numbers) or not all(v is None or _number(v) for v in optional) \
                or not isinstance(state["rounds"], int) or not isinstance(state["failed_rounds"], int) \
                or not isinstance(state["last"], dict) or set(state["last"]) - set(_LAST_KEYS) \
                or not (state["hit"] is None or isinstance(state["hit"], dict)):
            raise ValueError(f"not a running summary: {state!r:.200}")
        return cls(**state)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
