"""A population host's pre-summed update for linear strategies: its members' updates, each checked as the
coordinator checks an upload (protocol/codec.check_report and first_non_finite), added into one weighted
sum that the coordinator checks and folds as one (HostPartial in protocol/fedpar.proto).

Members come one at a time (:meth:`HostSum.add`: a seat's update) or stacked (:meth:`HostSum.add_stacked`: a batched
trainer's parameters with a leading member axis, summed with one tensordot per tensor). The sum is kept in float64
and sent as the weighted mean in the model's dtypes (the coordinator folds it with the total weight).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import FLOAT_DTYPES, ModelLayout, check_report, first_non_finite, layout_to_pb, wire_bytes


def summable(layout: ModelLayout) -> bool:
    """Whether updates of ``layout`` can be pre-summed: every tensor floating (an integer buffer's mean would round)."""
    return all(t.dtype in FLOAT_DTYPES for t in layout.tensors)


class HostSum:
    """One partial of round ``round_id``: the weighted sum of the members' updates added so far and who they are.

    ``registered(member)`` is the member's registered examples and the round's local epochs (its weight's bound).
    A member whose update fails a check is left out: :meth:`add` raises the ValueError, :meth:`add_stacked` returns
    it in that member's place.
    """

    def __init__(self, layout: ModelLayout, round_id: int, metric_names: Sequence[str]):
        if not summable(layout):
            raise ValueError("updates with integer tensors cannot be pre-summed")
        self.layout, self.round_id, self.metric_names = layout, round_id, tuple(metric_names)
        self.sums = [np.zeros(t.shape, np.float64) for t in layout.tensors]
        self.members: list[str] = []
        self.task_ids: list[str] = []
        self.weights: list[int] = []
        self.steps: list[int] = []
        self.metric_values: list[float] = []

    def __len__(self) -> int:
        return len(self.members)

    def _admit(self, member: str, task_id: str, arrays: Sequence[np.ndarray], weight: int, steps: int,
               metrics: Mapping[str, float], registered: tuple[int, int]) -> None:
        """Check one member's update as the coordinator would; note it (its arrays still to be added)."""
        if tuple(sorted(metrics)) != tuple(sorted(self.metric_names)):
            raise ValueError(f"member {member!r} reports metrics {sorted(metrics)}, not the partial's "
                             f"{sorted(self.metric_names)}")
        if member in self.members:
            raise ValueError(f"member {member!r} is in this partial already; each update counts once")
        check_report(weight, registered[0], registered[1], steps, metrics)
        shapes = [tuple(np.shape(a)) for a in arrays]
        if shapes != [t.shape for t in self.layout.tensors]:
            raise ValueError(f"member {member!r}'s tensors have shapes {shapes}, not the model's")
        bad = first_non_finite(self.layout, arrays)
        if bad is not None:
            raise ValueError(f"tensor {bad!r} contains NaN or Inf; update refused")
        self.members.append(member)
        self.task_ids.append(task_id)
        self.weights.append(int(weight))
        self.steps.append(int(steps))
        self.metric_values += [float(metrics[n]) for n in self.metric_names]

    def add(self, member: str, task_id: str, arrays: Sequence[np.ndarray], weight: int, steps: int,
            metrics: Mapping[str, float], registered: tuple[int, int]) -> None:
        """Check member's update (its new weights, in the layout's order) and add it with ``weight``; a ValueError
        (nothing added) if it fails a check."""
        self._admit(member, task_id, arrays, weight, steps, metrics, registered)
        for total, array in zip(self.sums, arrays):
            total += np.asarray(array, np.float64) * weight

    def add_stacked(self, members: Sequence[str], task_ids: Sequence[str], stacked: Sequence[np.ndarray],
                    weights: Sequence[int], steps: Sequence[int], metrics: Sequence[Mapping[str, float]],
                    registered: Sequence[tuple[int, int]]) -> list[ValueError | None]:
        """Add members' updates stacked on a leading member axis (one array per tensor of the layout, shape
        ``(len(members), *tensor shape)``), each weighted by its ``weights`` entry; per member, None (added) or the
        ValueError that left it out."""
        errors: list[ValueError | None] = []
        taken = np.zeros(len(members), np.float64)
        for j, member in enumerate(members):
            try:
                self._admit(member, task_ids[j], [x[j] for x in stacked], weights[j], steps[j], metrics[j],
                            registered[j])
                taken[j] = weights[j]
                errors.append(None)
            except ValueError as exc:
                errors.append(exc)
        for total, x in zip(self.sums, stacked):  # a left-out member weighs 0 (it is finite-checked only if taken)
            x = np.asarray(x)
            if not np.all(taken > 0):
                x = np.where(taken.reshape((-1,) + (1,) * (x.ndim - 1)) > 0, x, 0)
            total += np.tensordot(taken, x.astype(np.float64, copy=False), axes=1)
        return errors

    def message(self) -> pb.HostPartial:
        """The partial to send: the members' weighted mean in the model's dtypes, and their arrays."""
        total = sum(self.weights)
        mean = [(s / total).astype(t.dtype) for s, t in zip(self.sums, self.layout.tensors)]
        return pb.HostPartial(round=self.round_id, member_ids="\n".join(self.members),
                              task_ids="\n".join(self.task_ids), num_examples=self.weights, steps=self.steps,
                              metric_names=self.metric_names, metric_values=self.metric_values,
                              tensors=layout_to_pb(self.layout), total_bytes=self.layout.total_bytes,
                              data=wire_bytes(mean))
