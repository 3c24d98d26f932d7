"""Byzantine-robust rules that need all updates at once: coordinate-wise median, trimmed mean, (Multi-)Krum.

Memory, for K updates of a model with P parameters (a "model" is P parameters in the model's dtypes):

* during the round: exactly one copy of each update, K models;
* at finish, column-chunk scratch: a float64 block of K x c values (c = max(1024, 32 MiB / (8 K)) columns,
  so 32 MiB, or K x 8 KiB past K = 4096); at most 3 such blocks are alive at once (the previous block, the
  next one and the stack it is converted from; median and trimmed mean partition a copy of the block, Krum takes the
  differences of its rows into one);
* Median and TrimmedMean (``combine_columns``): a float64 output of the model size, 8 P bytes (two float32
  models), kept until it is cast back into the new model (one more model; none more for float64 models);
* Krum and Multi-Krum: a K x K float64 distance matrix; then, while averaging the chosen updates tensor by
  tensor, a float64 accumulator and a float64 product temporary of that tensor's size (16 bytes x the largest
  tensor: for a one-tensor model, two model-sized float64 arrays), and the new model (with float64 models
  the accumulators are the new model: a model-sized float64 output).

So the finish adds about 8 P bytes plus one model (Krum: up to 16 bytes x the largest tensor plus one model)
on top of the K stored models, plus the bounded scratch. They are unweighted (num_examples only weights
Multi-Krum's final average), as in the original papers and Flower.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from fedpar.aggregation.accumulator import ShapesAndDtypes, cast_like, check_weight
from fedpar.aggregation.catalog import register_strategy
from fedpar.aggregation.strategy import FoldItem, Strategy

log = logging.getLogger(__name__)

_STORE_MEMORY = ("holds one copy of every update of the round (K models in the model dtypes), so memory grows "
                 "linearly with the cohort size; at finish, at most 3 K x chunk float64 scratch blocks (~32 MiB each)")
_ROBUST_MEMORY = (_STORE_MEMORY + ", plus a float64 output of the model size (8 bytes per parameter) that is "
                  "cast into the new model (one more model)")
_KRUM_MEMORY = (_STORE_MEMORY + ", a K x K float64 distance matrix, plus, tensor by tensor, a float64 accumulator "
                "and a float64 product temporary of the tensor's size (16 bytes x the largest tensor: two model-sized "
                "float64 arrays for a one-tensor model) and the new model")


class UpdateStore:
    """One flat copy of each update of a round, plus weights; read back in column chunks."""

    def __init__(self, shapes: ShapesAndDtypes, scratch_bytes: int = 32 << 20) -> None:
        """Empty store for ``shapes``; ``scratch_bytes`` bounds the K x chunk work block."""
        self.shapes = shapes
        self.updates: list[list[np.ndarray]] = []
        self.weights: list[float] = []
        self.scratch_bytes = scratch_bytes
        self._lock = threading.Lock()

    def add(self, update: Sequence[np.ndarray], weight: float, who: str) -> None:
        """Copy ``update`` in after checking shapes and finiteness."""
        arrays = self.shapes.check_update(update, who)
        copy = [np.array(a, copy=True).ravel() for a in arrays]
        with self._lock:
            self.updates.append(copy)
            self.weights.append(float(weight))

    def __len__(self) -> int:
        """Number of stored updates."""
        return len(self.updates)

    def chunks(self) -> Iterator[tuple[int, int, int, np.ndarray]]:
        """Yield ``(array index, start, stop, K x (stop-start) float64 block)`` covering every parameter."""
        k = max(1, len(self.updates))
        step = max(1024, self.scratch_bytes // (8 * k))
        for i, size in enumerate(self.shapes.sizes):
            for s in range(0, size, step):
                e = min(s + step, size)
                yield i, s, e, np.stack([u[i][s:e] for u in self.updates]).astype(np.float64, copy=False)

    def combine_columns(self, fn) -> list[np.ndarray]:
        """Apply ``fn(K x n block) -> n values`` column-chunk by chunk; returns arrays shaped and typed as the model."""
        out = [np.empty(size, np.float64) for size in self.shapes.sizes]
        for i, s, e, block in self.chunks():
            out[i][s:e] = fn(block)
        return [cast_like(o, d).reshape(sh) for o, d, sh in zip(out, self.shapes.dtypes, self.shapes.shapes)]

    def squared_distances(self) -> np.ndarray:
        """K x K squared Euclidean distances between stored updates, summed over chunks of their differences."""
        d = np.zeros((len(self.updates),) * 2)
        for _, _, _, block in self.chunks():
            _add_squared_distances(d, block)
        return d + d.T


def _add_squared_distances(upper: np.ndarray, block: np.ndarray) -> None:
    """Add the squared distances between the rows of ``block`` into the upper triangle of ``upper`` (one more
    block of scratch, freed before the next chunk is read)."""
    # Not |a|^2 + |b|^2 - 2 a.b (a Gram matrix): when honest updates sit close together and attackers far away,
    # Krum's very case, that cancels to noise (scores off by 10x, another update picked).
    k = block.shape[0]
    diff = np.empty_like(block)
    for i in range(k - 1):
        rows = np.subtract(block[i + 1:], block[i], out=diff[: k - 1 - i])
        upper[i, i + 1:] += np.einsum("ij,ij->i", rows, rows)


class BufferedStrategy(Strategy):
    """Base for strategies that see all updates at finish."""

    memory_note = _ROBUST_MEMORY
    linear = False  # a median, a trimmed mean or Krum's pick needs the updates themselves

    def __init__(self) -> None:
        """No store until a round begins."""
        super().__init__()
        self._store: UpdateStore | None = None

    def _reset_round(self, shapes: ShapesAndDtypes) -> None:
        """Fresh store for the round."""
        self._store = UpdateStore(shapes)

    def _fold(self, update: Sequence[np.ndarray], num_examples: int, who: str, known_finite: bool) -> None:
        """Keep one copy of the update (checked for NaN/Inf as it is copied, whatever ``known_finite`` says)."""
        assert self._store is not None
        self._store.add(update, check_weight(num_examples), who)

    def handoff(self) -> list[FoldItem]:
        """Every stored update: rank 0 needs them all (server/ranks/)."""
        if self._store is None:
            return []
        store = self._store
        return [FoldItem([u.reshape(shape) for u, shape in zip(update, store.shapes.shapes)], weight)
                for update, weight in zip(store.updates, store.weights)]

    def _num_folded(self) -> int:
        """Stored updates."""
        return len(self._store) if self._store is not None else 0

    def _drop_round(self) -> None:
        """Release the stored updates."""
        self._store = None


@register_strategy
class Median(BufferedStrategy):
    """Coordinate-wise median of the clients' weights (Yin et al. 2018)."""

    name = "median"

    def _finish(self, global_weights: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]]:
        """Median per coordinate."""
        assert self._store is not None
        return self._store.combine_columns(lambda b: np.median(b, axis=0)), {}


@register_strategy
class TrimmedMean(BufferedStrategy):
    """Coordinate-wise mean after dropping the ``beta`` fraction of largest and of smallest values (Yin et al. 2018)."""

    name = "trimmed_mean"

    def __init__(self, beta: float = 0.2) -> None:
        """``beta`` in [0, 0.5): fraction cut from each end (as scipy's trim_mean / Flower's FedTrimmedAvg)."""
        super().__init__()
        if not 0 <= beta < 0.5:
            raise ValueError(f"beta must be in [0, 0.5), got {beta}")
        self.beta = float(beta)

    def _finish(self, global_weights: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]]:
        """Sort each column, average the middle."""
        assert self._store is not None
        k = len(self._store)
        cut = int(self.beta * k)

        def trimmed(block: np.ndarray) -> np.ndarray:
            if cut == 0:
                return block.mean(axis=0)
            part = np.partition(block, (cut, k - cut - 1), axis=0)
            return part[cut: k - cut].mean(axis=0)

        return self._store.combine_columns(trimmed), {"trimmed_per_side": float(cut)}


@register_strategy
class Krum(BufferedStrategy):
    """Krum (Blanchard et al. 2017): the update closest to its ``n - f - 2`` nearest neighbours; Multi-Krum averages
    the best ``m``."""

    name = "krum"
    memory_note = _KRUM_MEMORY

    def __init__(self, num_malicious: int = 0, num_selected: int = 1) -> None:
        """``num_malicious`` = f; ``num_selected`` = m (1 is Krum; m > 1 averages the m best, weighted by
        num_examples)."""
        super().__init__()
        if num_malicious < 0 or num_selected < 1:
            raise ValueError("num_malicious must be >= 0 and num_selected >= 1")
        self.num_malicious = int(num_malicious)
        self.num_selected = int(num_selected)
        self._said_too_few = False

    def scores(self) -> np.ndarray:
        """Krum score of every stored update: sum of squared distances to its n - f - 2 closest others."""
        assert self._store is not None
        d = self._store.squared_distances()
        n = d.shape[0]
        closest = max(1, n - self.num_malicious - 2)
        scores = np.empty(n)
        for i in range(n):
            others = np.delete(d[i], i)
            scores[i] = np.sort(others)[:closest].sum() if n > 1 else 0.0
        return scores

    def _finish(self, global_weights: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]]:
        """Select by score and average the selection."""
        assert self._store is not None
        store = self._store
        if len(store) <= 2 * self.num_malicious + 2 and not self._said_too_few:
            self._said_too_few = True  # once a run: every round of a fixed cohort size would say it again
            log.warning("%s: %d updates in round %d, but its guarantee against f=%d Byzantine updates needs more "
                        "than 2f+2=%d; lower f (--strategy-option f=...) or raise --clients-per-round", self.name,
                        len(store), self.round_id, self.num_malicious, 2 * self.num_malicious + 2)
        chosen = np.argsort(self.scores(), kind="stable")[: min(self.num_selected, len(store))]
        w = np.array([store.weights[j] for j in chosen])
        w = w / w.sum() if w.sum() > 0 else np.full(len(chosen), 1.0 / len(chosen))
        out = []
        for i, (shape, dtype) in enumerate(zip(store.shapes.shapes, store.shapes.dtypes)):
            acc = np.zeros(store.shapes.sizes[i], np.float64)
            for j, wj in zip(chosen, w):
                acc += wj * store.updates[j][i]
            out.append(cast_like(acc, dtype).reshape(shape))
        return out, {"selected": float(len(chosen)), "first_selected_index": float(chosen[0])}


@register_strategy
class MultiKrum(Krum):
    """Multi-Krum (El Mhamdi et al. 2018): weighted mean of the ``m`` best-scoring updates (default m = n - f at
    finish)."""

    name = "multikrum"

    def __init__(self, num_malicious: int = 0, num_selected: int = 0) -> None:
        """``num_selected`` 0 means n - f."""
        if num_selected < 0:  # max(1, ...) below would make it Krum's 1 in silence
            raise ValueError(f"num_selected must be >= 0 (0: n - f), got {num_selected}")
        super().__init__(num_malicious, max(1, num_selected))
        self._auto = num_selected == 0

    def _finish(self, global_weights: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]]:
        """Resolve m = n - f when asked, then as Krum."""
        if self._auto:
            assert self._store is not None
            self.num_selected = max(1, len(self._store) - self.num_malicious)
        return super()._finish(global_weights)
