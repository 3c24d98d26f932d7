"""How skewed a partition is: per-client label counts and mean label entropy (for the partitioner tests)."""

from __future__ import annotations

import numpy as np


def label_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int | None = None) -> np.ndarray:
    """(clients, classes) matrix of how many examples of each label every client holds."""
    labels = np.asarray(labels)
    k = int(num_classes) if num_classes is not None else int(labels.max()) + 1
    return np.stack([np.bincount(labels[p], minlength=k) for p in parts])


def mean_label_entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Average over clients of the entropy (nats) of the client's label distribution; lower = more skewed."""
    counts = label_counts(labels, parts).astype(np.float64)
    probs = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(probs > 0, -probs * np.log(probs), 0.0)
    return float(terms.sum(axis=1).mean())
