"""Synthetic(alpha, beta), the FedProx paper's generated federated benchmark (Li et al., MLSys 2020, section 5.1).

Client k draws its own model and its own inputs: u_k ~ N(0, alpha), B_k ~ N(0, beta); W_k (10 x 60) and b_k (10)
have entries ~ N(u_k, 1); v_k has entries ~ N(B_k, 1); its inputs are x ~ N(v_k, Sigma) with Sigma diagonal,
Sigma_jj = j^-1.2, and its labels y = argmax(W_k x + b_k). alpha sets how much the clients' models differ, beta how
much their inputs do (Synthetic(0, 0) to (1, 1) in the paper). Client sizes follow a power law as in the paper,
here a log-normal around ``samples`` (the paper's clients hold hundreds of examples; populations of 100,000 need
a few each). Every client is generated from (seed, k) alone, so every process builds the same data. A fifth of
each client's examples (one at least, for clients of two or more) goes to the pooled test set; ``train_owners``
says whose each training example is, for ``--partition natural``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedpar.datasets.arrays import DatasetSplits
from fedpar.datasets.tables import owned_splits

DIM, CLASSES = 60, 10
CHUNK = 512  # clients generated at once (a chunk's per-example model gather stays near 40 MiB)


@dataclass(frozen=True)
class SyntheticSpec:
    """Which Synthetic(alpha, beta) federation: its knobs, its number of clients and their median size."""

    alpha: float = 0.5
    beta: float = 0.5
    clients: int = 100
    samples: float = 10.0  # median examples per client (log-normal, sigma 1, as a power law)
    seed: int = 0

    @staticmethod
    def parse(name: str, clients: int | None = None) -> SyntheticSpec:
        """``synthetic[:ALPHA:BETA[:CLIENTS[:SAMPLES]]]``; ``clients`` fills in CLIENTS when the name has none."""
        parts = name.split(":")
        if parts[0] != "synthetic" or len(parts) > 5:
            raise ValueError(f"bad synthetic dataset name {name!r}; use synthetic:ALPHA:BETA[:CLIENTS[:SAMPLES]]")
        try:
            alpha, beta = (float(p) for p in parts[1:3]) if len(parts) >= 3 else (0.5, 0.5)
            count = int(parts[3]) if len(parts) >= 4 else clients
            samples = float(parts[4]) if len(parts) == 5 else SyntheticSpec.samples
        except ValueError:
            raise ValueError(f"bad synthetic dataset name {name!r}; ALPHA, BETA and SAMPLES are numbers, "
                             "CLIENTS a whole number") from None
        if count is None or count < 1 or alpha < 0 or beta < 0 or samples <= 0:
            raise ValueError(f"synthetic dataset {name!r} needs CLIENTS >= 1 (or --clients), ALPHA and BETA >= 0 "
                             "and SAMPLES > 0")
        return SyntheticSpec(alpha, beta, count, samples)


    @property
    def name(self) -> str:
        """The dataset name that says all of it."""
        return f"synthetic:{self.alpha:g}:{self.beta:g}:{self.clients}:{self.samples:g}"


def client_sizes(spec: SyntheticSpec) -> np.ndarray:
    """Examples per client: 2 + a log-normal draw around ``samples``, capped at 50x it."""
    rng = np.random.default_rng([spec.seed, 0])
    drawn = rng.lognormal(np.log(spec.samples), 1.0, spec.clients)
    return 2 + np.minimum(drawn, 50 * spec.samples).astype(np.int64)


def generate(spec: SyntheticSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every client's examples: x (float32, n x 60), y (int64) and the owning client of each (int64)."""
    sizes = client_sizes(spec)
    scale = np.arange(1, DIM + 1, dtype=np.float64) ** -0.6  # sqrt of Sigma_jj = j^-1.2
    x_all = np.empty((int(sizes.sum()), DIM), np.float32)  # filled chunk by chunk: no second copy to concatenate
    y_all = np.empty(len(x_all), np.int64)
    ends = np.cumsum(sizes)
    for lo in range(0, spec.clients, CHUNK):
        hi = min(lo + CHUNK, spec.clients)
        rng = np.random.default_rng([spec.seed, 1, lo])
        n = hi - lo
        u = rng.normal(0.0, np.sqrt(spec.alpha), n) if spec.alpha else np.zeros(n)
        b_mean = rng.normal(0.0, np.sqrt(spec.beta), n) if spec.beta else np.zeros(n)
        w = rng.normal(u[:, None, None], 1.0, (n, CLASSES, DIM))
        b = rng.normal(u[:, None], 1.0, (n, CLASSES))
        v = rng.normal(b_mean[:, None], 1.0, (n, DIM))
        owner = np.repeat(np.arange(n), sizes[lo:hi])
        x = v[owner] + rng.standard_normal((len(owner), DIM)) * scale
        logits = np.einsum("ncd,nd->nc", w.astype(np.float32)[owner], x.astype(np.float32)) + b[owner]
        start = ends[lo] - sizes[lo]
        x_all[start:start + len(owner)] = x
        y_all[start:start + len(owner)] = logits.argmax(axis=1)
    return x_all, y_all, np.repeat(np.arange(spec.clients), sizes)


def load_synthetic(spec: SyntheticSpec) -> DatasetSplits:
    """The federation as train and test sets, with the owner of every training example."""
    x, y, owners = generate(spec)
    return owned_splits(x, y, owners, CLASSES)
