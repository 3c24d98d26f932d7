"""PNG plots of a run's per-round metrics."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure registry
from matplotlib.ticker import MaxNLocator


def plot_accuracy(rows: list[dict], path: Path, title: str = "") -> None:
    """Test accuracy (and federated evaluation, if any) against the round number."""
    fig = Figure(figsize=(6, 4), dpi=110)
    ax = fig.subplots()
    rounds = [r["round"] for r in rows]
    for key, label in (("test_accuracy", "central test accuracy"),
                       ("federated_eval_accuracy", "federated evaluation (clients' validation)")):
        values = [r.get(key) for r in rows]
        if any(v is not None for v in values):
            ax.plot(rounds, values, marker="o", label=label)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)


def plot_label_counts(counts, path: Path, title: str = "") -> None:
    """A heat map of the examples of each class (x) each client (y) holds."""
    fig = Figure(figsize=(6, max(3.0, min(12.0, 0.12 * len(counts) + 1.5))), dpi=110)
    ax = fig.subplots()
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=ax, label="examples")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
