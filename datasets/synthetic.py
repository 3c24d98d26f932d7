"""Synthetic(alpha, beta), the FedProx paper's generated federated benchmark (Li et al., MLSys 2020, section 5.1).

Client k draws its own model and its own inputs: u_k ~ N(0, alpha), B_k ~ N(0, beta) (alpha and beta are standard
deviations, as in the paper's generator, FedProx's data/synthetic_*/generate_synthetic.py); W_k (10 x 60) and b_k
(10) have entries ~ N(u_k, 1); v_k has entries ~ N(B_k, 1); its inputs are x ~ N(v_k, Sigma) with Sigma diagonal,
Sigma_jj = j^-1.2, and its labels y = argmax(W_k x + b_k). alpha sets how much the clients' models differ, beta how
much their inputs do (Synthetic(0, 0) to (1, 1) in the paper). Client sizes follow a power law as in the paper,
here a log-normal around ``samples`` (the paper's clients hold hundreds of examples; populations of 100,000 need
a few each).

Every client's W_k is its own draw even at alpha = 0 (u_k only adds the same amount to every class's score, so it
never changes a label): a client's labels say nothing about another's. A shared model learns the clients it trains
on (the paper evaluates its 30 clients, all of which train), never one it has not seen, which it scores at chance;
so the test accuracy of a population far larger than the clients its rounds sample stays near 0.1.
``synthetic:iid`` is the paper's Synthetic-IID instead: one W and b for every client, inputs x ~ N(0, Sigma), so
a shared model learns every client, seen or not.

Every client is generated from (seed, k) alone, when it is asked for (:class:`SyntheticMembers`): a population of
a million costs its sizes (8 bytes a client) until a round samples some. A fifth of each client's examples (one
at least, for clients of two or more) is held out; the central test set is the held-out examples of at most
TEST_MEMBERS clients spread evenly over the population (all of them in smaller ones). Partitions other than
``natural`` pool every client's training examples first (made when first read, if they fit in memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedpar.datasets.arrays import ArrayDataset, DatasetSplits, LazyDataset
from fedpar.datasets.catalog import register_dataset
from fedpar.datasets.memory import check_fits
from fedpar.datasets.partition import AUTO
from fedpar.datasets.tables import TEST_SHARE

DIM, CLASSES = 60, 10
TEST_MEMBERS = 2_000  # clients whose held-out examples make the central test set (evenly spread)
MAX_SPREAD = 1e3  # ALPHA and BETA at most: the paper's are 0..1; far larger ones overflow the float32 features
_SCALE = np.arange(1, DIM + 1, dtype=np.float64) ** -0.6  # sqrt of Sigma_jj = j^-1.2
# What a federation costs in memory, for the line that refuses one too big before anything is drawn (a name of
# 10^11 clients was a MemoryError traceback in every worker process)
SIZES_BYTES = 40  # a client's sizes in each process that loads the federation, at their peak while drawn
DRAWN_BYTES = 1_000  # an example while it is drawn (float64 normals, scaled and shifted, then kept as float32)
KEPT_BYTES = DIM * 4 + 8  # an example kept (x float32, y int64)


@dataclass(frozen=True)
class SyntheticSpec:
    """Which Synthetic(alpha, beta) federation: its knobs, its number of clients and their median size."""

    alpha: float = 0.5
    beta: float = 0.5
    clients: int = 100
    samples: float = 10.0  # median examples per client (log-normal, sigma 1, as a power law)
    seed: int = 0
    iid: bool = False  # the paper's Synthetic-IID: one model (W, b) for every client, inputs x ~ N(0, Sigma)

    @staticmethod
    def parse(name: str, clients: int | None = None, default: int | None = None) -> SyntheticSpec:
        """``synthetic[:ALPHA:BETA[:CLIENTS[:SAMPLES]]]`` or ``synthetic:iid[:CLIENTS[:SAMPLES]]``; ``clients``
        (--clients) fills in CLIENTS when the name has none, else ``default``."""
        parts = name.split(":")
        iid = len(parts) > 1 and parts[1] == "iid"
        if iid:
            parts[1:2] = ["0", "0"]  # Synthetic-IID: alpha and beta play no part
        if parts[0] != "synthetic" or len(parts) == 2 or len(parts) > 5:  # ALPHA comes with BETA, or neither
            raise ValueError(f"bad synthetic dataset name {name!r}; use synthetic:ALPHA:BETA[:CLIENTS[:SAMPLES]] "
                             "or synthetic:iid[:CLIENTS[:SAMPLES]]")
        try:
            alpha, beta = (float(p) for p in parts[1:3]) if len(parts) >= 3 else (0.5, 0.5)
            count = int(parts[3]) if len(parts) >= 4 else clients if clients is not None else default
            samples = float(parts[4]) if len(parts) == 5 else SyntheticSpec.samples
        except ValueError:
            raise ValueError(f"bad synthetic dataset name {name!r}; ALPHA, BETA and SAMPLES are numbers, "
                             "CLIENTS a whole number") from None
        finite = all(map(math.isfinite, (alpha, beta, samples)))  # 'nan' and 'inf' read as numbers too
        spread = 0 <= alpha <= MAX_SPREAD and 0 <= beta <= MAX_SPREAD  # larger: float32 features overflow to Inf/NaN
        if count is None or count < 1 or not finite or not spread or samples <= 0:
            # client and serve have no --clients to fill CLIENTS in: the name must say it
            form = "synthetic:iid:CLIENTS" if iid else "synthetic:ALPHA:BETA:CLIENTS"
            where = "(or --clients)" if clients is not None else f"in the name ({form})"
            raise ValueError(f"synthetic dataset {name!r} needs CLIENTS >= 1 {where}, ALPHA and BETA in "
                             f"0..{MAX_SPREAD:g} and SAMPLES > 0 (finite numbers)")
        return SyntheticSpec(alpha, beta, count, samples, iid=iid)

    @property
    def name(self) -> str:
        """The dataset name that says all of it."""
        kind = "iid" if self.iid else f"{self.alpha:g}:{self.beta:g}"
        return f"synthetic:{kind}:{self.clients}:{self.samples:g}"


def memory_needed(spec: SyntheticSpec, processes: int = 1, pooled: bool = False) -> float:
    """Bytes ``processes`` processes loading ``spec`` at once need, about: its clients' sizes in each, the central
    test set in one, and a client of the mean size drawn in each of the others (in the one, when alone); with
    ``pooled`` (a partition other than natural), every client's training examples pooled in each."""
    mean = 2 + spec.samples * math.exp(0.5)  # a log-normal's mean (sigma 1); the 50x cap only trims it
    tested = min(spec.clients, TEST_MEMBERS) * max(1.0, mean / TEST_SHARE)
    pool = processes * 2 * spec.clients * mean * (1 - 1 / TEST_SHARE) * KEPT_BYTES if pooled else 0.0
    return (processes * SIZES_BYTES * spec.clients + 2 * tested * KEPT_BYTES  # its parts, then joined
            + max(1, processes - 1) * mean * DRAWN_BYTES + pool)


def check_synthetic_fits(name: str, processes: int = 1, partition: str = "natural") -> None:
    """ValueError, one line saying how much memory the federation ``name`` (its CLIENTS said) needs in
    ``processes`` processes under ``partition`` and what to change, when this machine has less available."""
    check_spec_fits(SyntheticSpec.parse(name.lower()), processes, partition)


def check_spec_fits(spec: SyntheticSpec, processes: int = 1, partition: str = "natural") -> None:
    """:func:`check_synthetic_fits` of a parsed ``spec``."""
    pooled = partition.strip().lower() not in ("natural", AUTO)  # auto is natural for data with owners
    where = f" in {processes} processes" if processes > 1 else ""
    form = "synthetic:iid:CLIENTS:SAMPLES" if spec.iid else "synthetic:ALPHA:BETA:CLIENTS:SAMPLES"
    check_fits(memory_needed(spec, processes, pooled),
               f"--dataset {spec.name} ({spec.clients:,} clients of about {spec.samples:g} examples{where}"
               f"{f', pooled for --partition {partition}' if pooled else ''})",
               f"give fewer CLIENTS (or --clients) or a smaller SAMPLES ({form})"
               f"{', or use --partition natural (each client its own examples)' if pooled else ''}")


def client_sizes(spec: SyntheticSpec) -> np.ndarray:
    """Examples per client: 2 + a log-normal draw around ``samples``, capped at 50x it."""
    rng = np.random.default_rng([spec.seed, 0])
    drawn = rng.lognormal(np.log(spec.samples), 1.0, spec.clients)
    return 2 + np.minimum(drawn, 50 * spec.samples).astype(np.int64)


def held_out(sizes: np.ndarray) -> np.ndarray:
    """How many of each client's examples go to the test set: a fifth, one at least for clients of two or more."""
    return np.where(sizes >= 2, np.maximum(1, sizes // TEST_SHARE), 0)


def client_examples(spec: SyntheticSpec, k: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Client ``k``'s ``size`` examples, from (seed, k) alone (and, for Synthetic-IID, the model shared by all,
    from the seed): x (float32, size x 60) and y (int64)."""
    rng = np.random.default_rng([spec.seed, 1, k])
    if spec.iid:
        shared = np.random.default_rng([spec.seed, 2])
        w, b, v = shared.normal(0.0, 1.0, (CLASSES, DIM)), shared.normal(0.0, 1.0, CLASSES), np.zeros(DIM)
    else:
        u = rng.normal(0.0, spec.alpha) if spec.alpha else 0.0
        b_mean = rng.normal(0.0, spec.beta) if spec.beta else 0.0
        w = rng.normal(u, 1.0, (CLASSES, DIM))
        b = rng.normal(u, 1.0, CLASSES)
        v = rng.normal(b_mean, 1.0, DIM)
    x = (v + rng.standard_normal((size, DIM)) * _SCALE).astype(np.float32)
    return x, (x @ w.T.astype(np.float32) + b).argmax(axis=1).astype(np.int64)


class SyntheticMembers:
    """The federation's clients, each made from (seed, k) when asked for: ``sizes`` are their training examples."""

    def __init__(self, spec: SyntheticSpec):
        self.spec = spec
        self.all_sizes = client_sizes(spec)
        self.held = held_out(self.all_sizes)
        self.sizes = self.all_sizes - self.held

    def __len__(self) -> int:
        """Number of clients."""
        return len(self.sizes)

    def _made(self, k: int, held_only: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
        """Client ``k``'s examples (``held_only``: just its held-out ones, which come first: the same draws)."""
        if not 0 <= k < len(self):
            raise ValueError(f"client {k} is not in [0, {len(self)})")
        held = int(self.held[k])
        x, y = client_examples(self.spec, k, held if held_only else int(self.all_sizes[k]))
        return x, y, held

    def examples(self, k: int) -> ArrayDataset:
        """Client ``k``'s training examples."""
        x, y, held = self._made(k)
        return ArrayDataset(x[held:], y[held:])

    def labels(self, k: int) -> np.ndarray:
        """Client ``k``'s training labels."""
        return self.examples(k).y

    def test_examples(self, k: int) -> ArrayDataset:
        """Client ``k``'s held-out examples."""
        x, y, held = self._made(k, held_only=True)
        return ArrayDataset(x[:held], y[:held])

    def test_members(self) -> np.ndarray:
        """The clients whose held-out examples make the central test set."""
        return np.unique(np.linspace(0, len(self) - 1, min(len(self), TEST_MEMBERS)).astype(np.int64))

    def test_sample(self) -> ArrayDataset:
        """The central test set: the held-out examples of at most TEST_MEMBERS clients, evenly spread."""
        parts = [self.test_examples(int(k)) for k in self.test_members()]
        return ArrayDataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]))

    def pooled(self) -> ArrayDataset:
        """Every client's training examples in one set, client by client (for partitions other than natural)."""
        total = int(self.sizes.sum())
        check_fits(2 * total * (DIM * 4 + 8), f"pooling the {len(self):,} clients of {self.spec.name}",
                   "use --partition natural (each client's own examples, made when it is sampled)")
        x = np.empty((total, DIM), np.float32)
        y = np.empty(total, np.int64)
        at = 0
        for k in range(len(self)):
            part = self.examples(k)
            x[at:at + len(part)], y[at:at + len(part)] = part.x, part.y
            at += len(part)
        return ArrayDataset(x, y)


def load_synthetic(spec: SyntheticSpec) -> DatasetSplits:
    """The federation: its clients (made when asked for), their pooled training set and the central test sample
    (each made when first read: a worker process never reads them)."""
    members = SyntheticMembers(spec)
    return DatasetSplits(LazyDataset(members.pooled, int(members.sizes.sum())),
                         LazyDataset(members.test_sample, int(members.held[members.test_members()].sum())), CLASSES,
                         (DIM,), members=members)


def synthetic_name(name: str, clients: int) -> str:
    """``name`` with the client count of a federation of ``clients`` filled in when it names none."""
    return SyntheticSpec.parse(name.lower(), clients).name


@register_dataset("synthetic", usage="synthetic[:ALPHA:BETA[:CLIENTS[:SAMPLES]]]", full_name=synthetic_name,
                  fits=check_synthetic_fits, help="FedProx's generated federation (synthetic:iid: its IID one)")
def synthetic_dataset(name: str, clients: int | None = None, centralized: bool = False) -> DatasetSplits:
    """``--dataset synthetic[:...]``; ``clients`` when the name does not say how many, else, ``centralized`` (fedpar
    train, which pools the clients' examples), SyntheticSpec's default number (ValueError, one line, when this
    machine's memory cannot hold it)."""
    # a federation's processes must agree on its clients, so only a run that pools them all may take a default
    spec = SyntheticSpec.parse(name.lower(), clients, SyntheticSpec.clients if centralized else None)
    check_spec_fits(spec)
    return load_synthetic(spec)
