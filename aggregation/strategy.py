"""The server-side strategy interface (Flower-like) and the streaming base most strategies share."""

from __future__ import annotations

import abc
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, NamedTuple

import numpy as np

from fedpar.aggregation.accumulator import (FoldConfig, ShapesAndDtypes, WeightedSum, cast_like, check_weight,
                                            weighted_sum)
from fedpar.aggregation.errors import NoUpdatesError
from fedpar.aggregation.share_cap import ShareCap
from fedpar.protocol.task_settings import TaskSettings

# A strategy named flower:REF is a Flower Strategy class, REF being package.module:Class or path/file.py:Class.
FLOWER_PREFIX = "flower:"


class FoldItem(NamedTuple):
    """One client's update for :meth:`Strategy.fold_many`: its new full weights, weight and client id; or, with
    ``members``, a pre-summed block (a population host's partial): their weighted mean and total weight. ``clipped``:
    the client's own word that client-side DP clipped its update (None: it said nothing)."""

    update: Sequence[np.ndarray]
    num_examples: float
    client_id: str = ""
    members: tuple[str, ...] = ()
    clipped: bool | None = None


def _ids(item: FoldItem) -> tuple[str, ...]:
    """The clients ``item`` counts for."""
    return item.members or (item.client_id,)


def _who_of(item: FoldItem) -> str:
    """How refusals name ``item``."""
    return f"pre-summed update of {len(item.members)} clients" if item.members else _who(item.client_id)


def _who(client_id: str) -> str:
    """How refusals name an update."""
    return f"update from client {client_id!r}" if client_id else "update"


class Strategy(abc.ABC):
    """One federated round at the server: configure clients, fold updates in, finish with new global weights.

    Call order per round: ``begin_round`` -> any number of ``fold`` (thread-safe, one per complete,
    validated upload) or ``fold_many`` (several at once) -> ``finish`` or ``abort_round``.
    ``state_dict``/``load_state_dict`` carry the strategy's own cross-round state (momentum, Adam moments, round
    number) as arrays + JSON, no pickle.
    """

    name: ClassVar[str] = ""
    memory_note: ClassVar[str] = ""
    # Whether the new global model depends on a round's updates only through their weighted mean, so that a sum
    # taken elsewhere (masked by secure aggregation, or partial sums of aggregator ranks) folded as one update of
    # weight sum(w) gives the same result. Every strategy class declares it; none is assumed.
    linear: ClassVar[bool]
    # Whether client_config reads the open round's global model (a Flower strategy's configure_fit/configure_train):
    # a wrapper (DP-FedAvg) opens this strategy's round before asking it.
    configures_from_round: ClassVar[bool] = False
    # How the strategy's running sum folds; None for a strategy that keeps no running sum (it buffers or delegates).
    fold_config: FoldConfig | None = None

    def __init__(self) -> None:
        """Start with no round open."""
        self.round_id = 0
        self._global: list[np.ndarray] | None = None
        self._shapes: ShapesAndDtypes | None = None
        self._clients: set[str] = set()
        self._lock = threading.Lock()

    def accumulate_in(self, dtype: str | None = None, device: str | None = None) -> None:
        """Accumulate the running sum in ``dtype`` ("float32" or "float64") and on ``device`` ("host", or a torch
        device such as "cuda:0") from the next round on; None keeps what it has, as does a strategy with no sum."""
        if self.fold_config is not None:
            self.fold_config = replace(self.fold_config, accumulate_dtype=dtype or self.fold_config.accumulate_dtype,
                                       device=device or self.fold_config.device)

    def cap_shares(self, share: float) -> None:
        """Cap each update's share of a round's total weight at ``share`` (``--max-agent-share``); a ValueError
        for strategies that do not weight updates by their example counts."""
        raise ValueError(f"strategy {self.name!r} does not weight updates by example count, so "
                         "--max-agent-share does not apply to it; leave it unset")

    def client_config(self, round_id: int) -> TaskSettings:
        """Task settings sent to every client sampled in ``round_id`` (none by default)."""
        return TaskSettings()

    def aggregate_evaluation(self, reports: Sequence[Mapping[str, float]]) -> dict[str, float] | None:
        """The round's federated evaluation from the accepted members' reports (``eval_examples``, ``eval_loss``,
        ...); None: the coordinator's example-weighted means (a Flower strategy's aggregate_evaluate answers)."""
        return None

    def begin_round(self, round_id: int, global_weights: Sequence[np.ndarray]) -> None:
        """Open ``round_id`` on top of ``global_weights`` (kept by reference: do not mutate them until finish)."""
        shapes = ShapesAndDtypes.of(global_weights)
        self._global = [np.asarray(a) for a in global_weights]
        self._shapes = shapes
        self._clients = set()
        self.round_id = int(round_id)
        self._reset_round(shapes)

    def fold(self, update: Sequence[np.ndarray], num_examples: int, client_id: str = "",
             members: Sequence[str] = (), *, known_finite: bool = False, clipped: bool | None = None) -> None:
        """Count one client's new full weights (same shapes/dtypes as the global) with weight ``num_examples``; with
        ``members``, a pre-summed block: ``update`` is their weighted mean and ``num_examples`` their total weight
        (linear strategies only: :meth:`_fold_block`). ``clipped``: the client's report that client-side DP clipped
        its update, which only DP-FedAvg reads (aggregation/privacy.py).

        A ValueError means the update was refused and the round's state is unchanged. ``known_finite``: the
        caller already verified every value is finite (the coordinator does, as the bytes arrive), so the
        strategy skips its own NaN/Inf pass over the update.
        """
        self._check_open("fold")
        item = FoldItem(update, num_examples, client_id, tuple(members))
        self._claim_all(_ids(item))
        try:
            if item.members:
                self._fold_block(update, num_examples, len(item.members), _who_of(item), known_finite)
            else:
                self._fold(update, num_examples, _who(client_id), known_finite)
        except Exception:
            self._release_all(_ids(item))
            raise

    def fold_many(self, items: Sequence[FoldItem], *, known_finite: bool = False) -> list[ValueError | None]:
        """Count several clients' updates as :meth:`fold` counts them one by one in this order, in one pass where
        the strategy can (a streaming sum adds up to :attr:`group_size` per pass over its accumulator, bit for bit
        the one-by-one sum). Per item, None (counted) or the ValueError that refused it: a refused update leaves
        the round's state as it was, and the others still count."""
        errors: list[ValueError | None] = []
        for item in items:
            reported = {} if item.clipped is None else {"clipped": item.clipped}  # (a subclass's fold may not take it)
            try:
                self.fold(item.update, item.num_examples, item.client_id, item.members, known_finite=known_finite,
                          **reported)
                errors.append(None)
            except ValueError as exc:
                errors.append(exc)
        return errors

    @property
    def group_size(self) -> int:
        """How many updates :meth:`fold_many` adds in one pass at most (1: this strategy counts them one by one)."""
        return 1

    # --- aggregator ranks (server/ranks/): each rank folds its share of a round's updates; rank 0 finishes ---
    @property
    def folded(self) -> int:
        """Updates this copy of the strategy took this round (held back or handed on ones included)."""
        return self._num_folded()

    def check_ranks(self, ranks: int) -> None:
        """ValueError, one line, when a round split over ``ranks`` aggregator ranks would lose the other ranks'
        updates: this strategy keeps no :meth:`partial_sum` and hands none on to rank 0 (:meth:`handoff`)."""
        cls = type(self)
        if ranks > 1 and cls.partial_sum is Strategy.partial_sum and cls.handoff is Strategy.handoff:
            raise ValueError(f"--aggregator-ranks {ranks} cannot run with --strategy {self.name}: it keeps no partial "
                             "sum (partial_sum) and hands no updates to rank 0 (handoff), so the other ranks' updates "
                             "would be lost; use one aggregator rank")

    def partial_sum(self) -> WeightedSum | None:
        """The running sum that aggregator ranks add up at a round's close (None: this strategy keeps none)."""
        return None

    def partial_counts(self) -> list[float]:
        """Numbers this rank's copy kept this round that rank 0 needs too (the same length on every rank)."""
        return []

    def merge_counts(self, others: Sequence[Sequence[float]]) -> None:
        """Rank 0: take the other ranks' :meth:`partial_counts` in."""

    def handoff(self) -> list[FoldItem]:
        """The updates this rank hands to rank 0 at the close, beyond its partial sum (robust rules: every one)."""
        return []

    def take_handoff(self, items: Sequence[FoldItem]) -> None:
        """Rank 0: count the updates the other ranks handed on, as if they had been folded here."""
        for item in items:
            self.fold(item.update, item.num_examples, item.client_id)

    def round_values(self) -> list[float]:
        """Rank 0's settings of the open round that every rank's copy must fold with (e.g. DP's clip norm)."""
        return []

    def set_round_values(self, values: Sequence[float]) -> None:
        """Another rank: fold this round with rank 0's :meth:`round_values`."""

    # --- secure aggregation (server/secure_round.py): the coordinator sees only the unmasked sum ---
    def secure_sum_refusal(self) -> str | None:
        """Why a round of this strategy cannot take the unmasked sum of masked updates (one line), or None."""
        if self.linear:
            return None
        return f"secure aggregation reveals only the weighted mean, which strategy {self.name!r} cannot use"

    @property
    def privacy_level(self) -> str:
        """The DP this strategy adds, as the composition table tells modes apart (aggregation/compatibility.py)."""
        return "off"

    @property
    def secure_values(self) -> int:
        """How many values each agent adds to a secure round's masked vector after its update (e.g. DP's clip bit)."""
        return 0

    def fold_secure_sum(self, mean: Sequence[np.ndarray], total_weight: int, agents: int,
                        sums: Sequence[float] = ()) -> None:
        """Count a secure round's unmasked result: the weighted mean of ``agents`` agents' updates, their total
        weight, and the sums of their :attr:`secure_values`; by default one update of that weight (a linear
        strategy's new model is the same)."""
        self.fold(mean, total_weight, "secure-aggregate")

    def _check_open(self, call: str) -> None:
        """RuntimeError unless a round is open."""
        if self._shapes is None:
            raise RuntimeError(f"{call}() called with no open round; call begin_round(round_id, global_weights) "
                               "first")

    def _claim_all(self, client_ids: Sequence[str]) -> None:
        """Note these clients' update (one, or a pre-summed block) for this round; a ValueError, claiming none, if
        any sent one already or is named twice."""
        named = [c for c in client_ids if c]
        with self._lock:
            seen = next((c for c in named if c in self._clients), None)
            if seen is None and len(set(named)) != len(named):
                seen = next(c for c in named if named.count(c) > 1)
            if seen is not None:
                raise ValueError(f"client {seen!r} already contributed to round {self.round_id}; "
                                 "each client may send one update per round")
            self._clients.update(named)

    def _release_all(self, client_ids: Sequence[str]) -> None:
        """Forget claimed updates that were then refused (the clients may send others)."""
        with self._lock:
            self._clients.difference_update(client_ids)

    def finish(self) -> tuple[list[np.ndarray], dict[str, float]]:
        """Close the round: the new global weights (input dtypes) and metrics. Raises NoUpdatesError if empty."""
        self._check_open("finish")
        assert self._global is not None
        if self._num_folded() == 0:
            raise NoUpdatesError(f"round {self.round_id} received no updates; keep the old global model "
                                 "(call abort_round) or wait for clients")
        new, metrics = self._finish(self._global)
        metrics = {"num_updates": float(self._num_folded()), **metrics,
                   "update_norm": _distance(new, self._global)}
        self._end_round()
        return new, metrics

    def abort_round(self) -> None:
        """Drop the open round's partial state; the strategy's cross-round state stays as it was."""
        self._end_round()

    def _end_round(self) -> None:
        """Forget the round's inputs."""
        self._global = None
        self._shapes = None
        self._clients = set()
        self._drop_round()

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Cross-round state as named arrays plus JSON-able metadata (no pickle)."""
        arrays, meta = self._state()
        return arrays, {"strategy": self.name, "round": self.round_id, **meta}

    def load_state_dict(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (for a resumed coordinator)."""
        if meta.get("strategy") != self.name:
            raise ValueError(f"state was saved by strategy {meta.get('strategy')!r}, not {self.name!r}; "
                             "resume with the same strategy")
        self.round_id = int(meta.get("round", 0))
        self._load_state(arrays, meta)

    # --- hooks for subclasses ---
    @abc.abstractmethod
    def _reset_round(self, shapes: ShapesAndDtypes) -> None:
        """Prepare empty per-round state for ``shapes``."""

    @abc.abstractmethod
    def _fold(self, update: Sequence[np.ndarray], num_examples: int, who: str, known_finite: bool) -> None:
        """Validate and count one update (thread-safe); ``known_finite``: skip the NaN/Inf check."""

    def _fold_block(self, mean: Sequence[np.ndarray], total_weight: float, count: int, who: str,
                    known_finite: bool) -> None:
        """Count a pre-summed block of ``count`` updates; only a linear strategy can (the others need each one)."""
        raise ValueError(f"strategy {self.name!r} needs each client's own update (it is not linear), so a "
                         "pre-summed update cannot be folded; send them one by one")

    @abc.abstractmethod
    def _num_folded(self) -> int:
        """Updates counted so far this round."""

    @abc.abstractmethod
    def _finish(self, global_weights: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]]:
        """Compute the new global weights and strategy-specific metrics."""

    @abc.abstractmethod
    def _drop_round(self) -> None:
        """Release per-round state."""

    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Strategy-specific cross-round state (none by default)."""
        return {}, {}

    def _load_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Restore strategy-specific cross-round state (none by default)."""


class StreamingStrategy(Strategy):
    """A strategy whose round state is one running weighted sum (memory: one model, any cohort size)."""

    memory_note = ("streaming: one accumulator of the model size (float32, or float64 if asked) whatever "
                   "the number of clients; updates are not retained")
    linear = True  # the round's state is the running weighted sum; the new model is made from its mean alone

    def __init__(self, fold_config: FoldConfig | None = None) -> None:
        """Use ``fold_config`` for the running sum."""
        super().__init__()
        self.fold_config = fold_config or FoldConfig()
        self._acc: WeightedSum | None = None
        self.max_share: float | None = None
        self._cap: ShareCap | None = None
        self._in_blocks = 0  # updates counted in pre-summed blocks beyond one each (the running sum counts one)

    def cap_shares(self, share: float) -> None:
        """Cap each update's share of a round's total weight (aggregation/share_cap.py: the heaviest few updates
        are held back, up to ceil(1/share) - 1 model copies, until the round closes)."""
        ShareCap(share)  # checks the value
        self.max_share = float(share)

    def _reset_round(self, shapes: ShapesAndDtypes) -> None:
        """A fresh zeroed accumulator (np.zeros maps zero pages lazily, so this costs no extra pass)."""
        self._acc = weighted_sum(shapes, self.fold_config)
        self._cap = ShareCap(self.max_share) if self.max_share is not None else None
        self._in_blocks = 0

    def _fold(self, update: Sequence[np.ndarray], num_examples: int, who: str, known_finite: bool) -> None:
        """Add the update into the running sum (with a share cap: unless it is among the heaviest so far)."""
        assert self._acc is not None
        if self._cap is None:
            self._acc.fold(update, num_examples, check_finite=not known_finite, who=who)
            return
        # Check now what the sum would check at fold time: a held update must not fail when the round closes.
        flat = [np.ravel(a) for a in self._acc.shapes.check(update, who)]
        if not known_finite and not self._acc.all_finite([flat]):
            raise ValueError(f"{who} contains NaN or Inf values; it was not counted")
        out = self._cap.offer(update, check_weight(num_examples))
        if out is not None:
            self._acc.fold(out[0], out[1], check_finite=False, who=who)

    def _fold_block(self, mean: Sequence[np.ndarray], total_weight: float, count: int, who: str,
                    known_finite: bool) -> None:
        """Add ``count`` updates' weighted mean with their total weight: their weighted sum, as one addition."""
        assert self._acc is not None
        if self._cap is not None:  # the cap may clip any one update's weight: it needs each update itself
            raise ValueError(f"{who} refused: with --max-agent-share each update's weight may be capped, which needs "
                             "the update itself; send them one by one")
        self._acc.fold(mean, total_weight, check_finite=not known_finite, who=who)
        with self._lock:
            self._in_blocks += count - 1

    def fold_secure_sum(self, mean: Sequence[np.ndarray], total_weight: int, agents: int,
                        sums: Sequence[float] = ()) -> None:
        """As one update of ``total_weight``, counted as the ``agents`` updates it sums (``num_updates``)."""
        super().fold_secure_sum(mean, total_weight, agents, sums)
        with self._lock:
            self._in_blocks += agents - 1

    @property
    def group_size(self) -> int:
        """Updates added per pass over the running sum (one by one under a share cap, which holds some back)."""
        return 1 if self.max_share is not None else self.fold_config.group_size

    def fold_many(self, items: Sequence[FoldItem], *, known_finite: bool = False) -> list[ValueError | None]:
        """As :meth:`Strategy.fold_many`: the running sum adds the group's accepted updates ``group_size`` per pass
        over the accumulator, so each block of it stays in cache while they are added."""
        if self._cap is not None or self._acc is None:  # the share cap offers updates one at a time
            return super().fold_many(items, known_finite=known_finite)
        errors: list[ValueError | None] = [None] * len(items)
        claimed = []
        for j, item in enumerate(items):
            try:
                self._claim_all(_ids(item))
                claimed.append(j)
            except ValueError as exc:
                errors[j] = exc
        try:
            refused = self._acc.fold_each([(items[j].update, items[j].num_examples, _who_of(items[j]))
                                           for j in claimed], check_finite=not known_finite)
        except Exception:
            for j in claimed:
                self._release_all(_ids(items[j]))
            raise
        for j, error in zip(claimed, refused):
            if error is not None:
                errors[j] = error
                self._release_all(_ids(items[j]))
            elif items[j].members:
                with self._lock:
                    self._in_blocks += len(items[j].members) - 1
        return errors

    def partial_sum(self) -> WeightedSum | None:
        """The running sum (without the updates the share cap holds back)."""
        return self._acc

    def partial_counts(self) -> list[float]:
        """The updates counted in pre-summed blocks beyond one each (the all-reduced running sum counts a block
        once), and under a share cap the total, largest weight and count of the updates folded at once."""
        return [float(self._in_blocks), *(self._cap.rest if self._cap is not None else ())]

    def merge_counts(self, others: Sequence[Sequence[float]]) -> None:
        """The other ranks' updates in pre-summed blocks count here too; under a share cap, their updates folded at
        once join the cap's count."""
        for in_blocks, *rest in others:
            self._in_blocks += int(in_blocks)
            if self._cap is not None:
                total, largest, count = rest
                self._cap.merge_rest(total, largest, int(count))

    def handoff(self) -> list[FoldItem]:
        """Under a share cap: the updates held back, with their full weights (rank 0 caps them with the rest)."""
        return [FoldItem(update, weight) for update, weight in self._cap.held_updates()] if self._cap else []

    def _num_folded(self) -> int:
        """Updates in the running sum (and held back by the share cap)."""
        held = self._cap.held if self._cap is not None else 0
        return (self._acc.count if self._acc is not None else 0) + held + self._in_blocks

    def _drop_round(self) -> None:
        """Forget the accumulator: after finish its buffer is the returned model (mean is taken in place)."""
        self._acc = None
        self._cap = None

    def _finish(self, global_weights: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]]:
        """Average, then let the subclass turn the average into the new global model."""
        assert self._acc is not None
        if self._cap is not None:
            for update, weight in self._cap.settle():
                self._acc.fold(update, weight, check_finite=False)
        total = self._acc.total_weight
        # In place: the accumulator is zeroed at the next begin_round anyway. Not yet in the model's dtypes: a server
        # optimizer steps from the mean itself (a float16 model's mean rounded first made FedAdam's delta 0).
        avg = self._acc.mean(inplace=True, cast=False)
        new = self._server_update(global_weights, avg)
        return [cast_like(a, dtype) for a, dtype in zip(new, self._acc.shapes.dtypes)], {"num_examples": float(total)}

    def _server_update(self, global_weights: list[np.ndarray], average: list[np.ndarray]) -> list[np.ndarray]:
        """New global weights from the weighted average of the clients' weights, that in the accumulation dtypes
        (FedAvg: the average)."""
        return average


def _distance(a: Sequence[np.ndarray], b: Sequence[np.ndarray], chunk: int = 1 << 20) -> float:
    """Euclidean distance between two models, in float64, one chunk at a time (bounded scratch memory)."""
    total = 0.0
    for x, y in zip(a, b):
        x, y = np.ravel(x), np.ravel(y)
        for s in range(0, x.size, chunk):
            d = x[s: s + chunk].astype(np.float64) - y[s: s + chunk]
            total += float(np.dot(d, d))
    return float(np.sqrt(total))
