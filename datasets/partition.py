"""Splitting a dataset's examples among federated clients: IID, Dirichlet label skew, label-sorted shards,
quantity skew.

Every partitioner returns one sorted int64 index array per client; together they cover each example exactly
once, and the result depends only on the inputs and ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedpar.datasets.rounding import round_shares
from fedpar.wording import counted

AUTO = "auto"  # natural where the data's examples have owners, else iid (datasets/clientdata.py)
DEFAULT_MIN_SIZE = 10
DEFAULT_MAX_ATTEMPTS = 1000
# Draws after which a hopeless minimum is given up: a draw leaving m clients short succeeds about e^-m of the time
# (Poisson), so once the draws so far average m > ln(remaining / HOPELESS), the rest succeed with chance < HOPELESS.
EARLY_DRAWS = 10
HOPELESS = 0.01
MAX_SIGMA = 100.0  # quantity:SIGMA's log-normal draws stay below exp(709), the largest float64, up to 10^8 clients


def _check_clients(num_examples: int, num_clients: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    if num_examples < num_clients:
        raise ValueError(f"cannot give {counted(num_clients, 'client')} at least one example each from "
                         f"{counted(num_examples, 'example')}; use fewer clients")


def _as_labels(labels: np.ndarray) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got {arr.dtype} with shape {arr.shape}")
    return arr


def partition_iid(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """A uniformly random split into ``num_clients`` parts whose sizes differ by at most one."""
    _check_clients(num_examples, num_clients)
    order = np.random.default_rng(seed).permutation(num_examples)
    return [np.sort(part).astype(np.int64) for part in np.array_split(order, num_clients)]


def partition_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
                        min_size: int = DEFAULT_MIN_SIZE,
                        max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> list[np.ndarray]:
    """Label skew as in Hsu et al. (2019): each class is shared out in Dirichlet(alpha) proportions.

    Smaller ``alpha`` means each client sees fewer classes. A client's count of a class, and its total, are the
    floor or the ceiling of its drawn share of them. Draws are repeated until every client has at least
    ``min_size`` examples, at most ``max_attempts`` times.
    """
    labels = _as_labels(labels)
    _check_clients(len(labels), num_clients)
    if not alpha > 0:
        raise ValueError(f"dirichlet alpha must be positive, got {alpha}")
    if min_size < 0 or min_size * num_clients > len(labels):
        fits = max(1, len(labels) // num_clients // 2)  # the least --partition takes
        raise ValueError(f"at least {min_size} examples per client is impossible with {num_clients} clients and "
                         f"{len(labels)} examples; give a lower minimum (dirichlet:{alpha:g}:MIN, e.g. "
                         f"dirichlet:{alpha:g}:{fits}) or use fewer clients")
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    smallest = short = 0
    for draw in range(1, max_attempts + 1):
        shuffled = [rng.permutation(members) for members in by_class]
        proportions = rng.dirichlet(np.full(num_clients, float(alpha)), size=len(by_class))
        # whole examples that follow the drawn shares, a client's total within one of its share (datasets/rounding.py)
        counts = round_shares(proportions, np.array([len(m) for m in by_class]), rng)
        owner = np.empty(len(labels), np.int64)
        for members, dealt in zip(shuffled, counts):
            owner[members] = np.repeat(np.arange(num_clients), dealt)
        by_owner = np.argsort(owner, kind="stable")  # each client's examples together, in ascending order
        parts = np.split(by_owner.astype(np.int64), np.cumsum(counts.sum(axis=0))[:-1])
        smallest = min(len(p) for p in parts)
        if smallest >= min_size:
            return parts
        short += sum(len(p) < min_size for p in parts)
        if EARLY_DRAWS <= draw < max_attempts and short / draw > math.log((max_attempts - draw) / HOPELESS):
            break  # the other draws would fail too: say so now, not after minutes of them (10,000 MNIST clients)
    raise ValueError(f"dirichlet partition: after {draw} draws some client still had fewer than "
                     f"{min_size} examples (last draw's smallest: {smallest}) with alpha={alpha:g}, "
                     f"{num_clients} clients and {len(labels)} examples; raise alpha, "
                     + (f"give a lower minimum (dirichlet:ALPHA:MIN, e.g. dirichlet:{alpha:g}:{max(smallest, 1)}) "
                        if min_size > 1 else "")  # MIN is at least 1: none lower than that
                     + "or use fewer clients")


def partition_shards(labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int) -> list[np.ndarray]:
    """McMahan et al.'s pathological non-IID split: sort by label, cut into shards, deal shards at random."""
    labels = _as_labels(labels)
    _check_clients(len(labels), num_clients)
    if shards_per_client < 1:
        raise ValueError(f"shards_per_client must be at least 1, got {shards_per_client}")
    num_shards = num_clients * shards_per_client
    if num_shards > len(labels):
        raise ValueError(f"{num_clients} clients x {shards_per_client} shards = {num_shards} shards, more than the "
                         f"{len(labels)} examples; use fewer clients or shards")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))  # random order within each label, then a stable sort by label
    order = order[np.argsort(labels[order], kind="stable")]
    shards = np.array_split(order, num_shards)
    dealt = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[s] for s in row])).astype(np.int64) for row in dealt]


def partition_quantity(num_examples: int, num_clients: int, sigma: float, seed: int) -> list[np.ndarray]:
    """Quantity skew: IID examples, but client sizes proportional to log-normal(0, ``sigma``) draws (each client
    one example at least), so a few clients hold much of the data; sigma 0 gives equal sizes."""
    _check_clients(num_examples, num_clients)
    rng = np.random.default_rng(seed)
    shares = rng.lognormal(0.0, sigma, num_clients)
    sizes = 1 + np.floor(shares / shares.sum() * (num_examples - num_clients)).astype(np.int64)
    sizes[np.argsort(-shares)[:num_examples - int(sizes.sum())]] += 1  # hand out what flooring left over
    order = rng.permutation(num_examples)
    return [np.sort(part).astype(np.int64) for part in np.split(order, np.cumsum(sizes)[:-1])]


@dataclass(frozen=True)
class PartitionSpec:
    """A parsed partition spec; call it with (labels, num_clients, seed) to get per-client indices."""

    kind: str
    alpha: float | None = None
    shards_per_client: int | None = None
    min_size: int = DEFAULT_MIN_SIZE
    sigma: float | None = None

    def __call__(self, labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
        """Partition the examples with these ``labels`` among ``num_clients`` clients."""
        if self.kind == "iid":
            return partition_iid(len(labels), num_clients, seed)
        if self.kind == "dirichlet":
            assert self.alpha is not None
            return partition_dirichlet(labels, num_clients, self.alpha, seed, min_size=self.min_size)
        if self.kind == "quantity":
            assert self.sigma is not None
            return partition_quantity(len(labels), num_clients, self.sigma, seed)
        assert self.kind == "shards" and self.shards_per_client is not None
        return partition_shards(labels, num_clients, self.shards_per_client, seed)

    def __str__(self) -> str:
        """The spec string this was parsed from (canonical form)."""
        if self.kind == "dirichlet":
            return f"dirichlet:{self.alpha:g}" + ("" if self.min_size == DEFAULT_MIN_SIZE else f":{self.min_size}")
        if self.kind == "shards":
            return f"shards:{self.shards_per_client}"
        if self.kind == "quantity":
            return f"quantity:{self.sigma:g}"
        return self.kind


PARTITION_HELP = ("one of: auto (natural where the examples have owners: synthetic, a table with a client column; "
                  "else iid), iid, dirichlet:ALPHA[:MIN] (e.g. dirichlet:0.5; MIN: fewest examples a client gets, "
                  "default 10), shards:K (e.g. shards:2), quantity:SIGMA "
                  "(e.g. quantity:1), natural (data with owners)")


def parse_partition(spec: str) -> PartitionSpec:
    """Parse "iid", "dirichlet:ALPHA[:MIN]" (ALPHA > 0, MIN >= 1 examples a client), "shards:K" (integer K >= 1) or
    "quantity:SIGMA" (0..MAX_SIGMA); "auto" is iid here (data whose examples have owners resolves it to natural first:
    clientdata.resolve_partition)."""
    kind, sep, arg = spec.strip().lower().partition(":")
    if kind in ("iid", AUTO) and not sep:
        return PartitionSpec("iid")
    if kind == "dirichlet" and arg:
        arg, _, least = arg.partition(":")
        try:
            alpha = float(arg)
        except ValueError:
            raise ValueError(f"bad partition {spec!r}: alpha {arg!r} is not a number; {PARTITION_HELP}") from None
        if not (alpha > 0 and np.isfinite(alpha)):
            raise ValueError(f"bad partition {spec!r}: alpha must be a positive number; {PARTITION_HELP}")
        if least and not (least.isdigit() and int(least) >= 1):
            raise ValueError(f"bad partition {spec!r}: MIN must be a whole number >= 1 (a client with no examples "
                             f"cannot train); {PARTITION_HELP}")
        return PartitionSpec("dirichlet", alpha=alpha, min_size=int(least) if least else DEFAULT_MIN_SIZE)
    if kind == "quantity" and arg:
        try:
            sigma = float(arg)
        except ValueError:
            raise ValueError(f"bad partition {spec!r}: sigma {arg!r} is not a number; {PARTITION_HELP}") from None
        if not 0 <= sigma <= MAX_SIGMA:
            raise ValueError(f"bad partition {spec!r}: sigma must be in [0, {MAX_SIGMA:g}] (from about 10, one client "
                             f"holds nearly every example); {PARTITION_HELP}")
        return PartitionSpec("quantity", sigma=sigma)
    if kind == "shards" and arg:
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"bad partition {spec!r}: K must be a positive integer; {PARTITION_HELP}")
        return PartitionSpec("shards", shards_per_client=int(arg))
    raise ValueError(f"bad partition {spec!r}; expected {PARTITION_HELP}")
