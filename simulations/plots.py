"""PNG plots of a run's per-round metrics."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from fedpar.protocol.atomicfile import atomic_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure


# (column, label, shift): federated evaluation is scored by the agents of round r on the global model they
# received, the model of round r - 1, so it is placed there (round 0: the initial model).
PANELS = {
    "accuracy": [("test_accuracy", "central test accuracy", 0),
                 ("federated_eval_accuracy", "federated evaluation (clients' validation)", -1)],
    "loss": [("train_loss", "train loss (clients' local training)", 0),
             ("test_loss", "central test loss", 0),
             ("federated_eval_loss", "federated evaluation loss (clients' validation)", -1)],
}


MARKED_POINTS = 100  # curves of more points are drawn as lines only
LOG_SPAN = 100.0  # a loss panel whose values span more than this factor gets a log axis
MAX_POINTS = 2000  # a curve keeps between this and twice this many points, however many rounds the run had


class _Thinned:
    """A curve arriving one point at a time, thinned to every stride-th point (the stride doubles whenever twice
    MAX_POINTS are held), plus its last point: a million-round run plots in bounded memory."""

    def __init__(self):
        self.xs: list[int] = []
        self.ys: list[float] = []
        self.stride, self.seen, self.tail = 1, 0, None

    def add(self, x: int, y: float) -> None:
        if self.seen % self.stride:
            self.tail = (x, y)
        else:
            self.xs.append(x)
            self.ys.append(y)
            self.tail = None
            if len(self.xs) >= 2 * MAX_POINTS:
                self.xs, self.ys, self.stride = self.xs[::2], self.ys[::2], 2 * self.stride
        self.seen += 1

    def points(self) -> tuple[list[int], list[float]]:
        if self.tail is None:
            return self.xs, self.ys
        return self.xs + [self.tail[0]], self.ys + [self.tail[1]]


def round_series(rows: Iterable[dict]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """What the plots of a run's rounds show: per panel ('accuracy', 'loss') and curve label, the rounds of the
    models scored and the values (curves without a value are left out). ``rows`` are read once, one at a time
    (e.g. streamed from metrics.jsonl); beyond 2 x MAX_POINTS rounds a curve is thinned evenly."""
    curves = {(panel, key, label, shift): _Thinned() for panel, entries in PANELS.items()
              for key, label, shift in entries}
    for row in rows:
        for (_, key, _, shift), curve in curves.items():
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                curve.add(row["round"] + shift, float(value))
    out: dict[str, dict[str, tuple[list[int], list[float]]]] = {panel: {} for panel in PANELS}
    for (panel, _, label, _), curve in curves.items():
        if curve.seen:
            out[panel][label] = curve.points()
    return out


def accuracy_limits(values: list[float]) -> tuple[float, float]:
    """The accuracy axis zoomed to the data, with a margin, inside [0, 1]."""
    low, high = min(values), max(values)
    margin = max(0.02, 0.08 * (high - low))
    return max(0.0, low - margin), min(1.0, high + margin)


def round_plots(rows: Iterable[dict], title: str = "") -> dict[str, Callable[[Path], None]]:
    """The plots of a federated run's rounds against the round of the model scored: 'accuracy.png' and
    'loss.png' (each only when it has a curve), each a function that draws it at the path it is given; ``rows``
    are read once (see :func:`round_series`)."""
    return {f"{panel}.png": functools.partial(_plot_panel, panel, curves, title)
            for panel, curves in round_series(rows).items() if curves}


def plot_rounds(rows: Iterable[dict], out_dir: Path, title: str = "") -> list[Path]:
    """Draw :func:`round_plots` in ``out_dir``; returns the files written."""
    written = []
    for name, draw in round_plots(rows, title).items():
        draw(Path(out_dir) / name)
        written.append(Path(out_dir) / name)
    return written


def _plot_panel(panel: str, curves: dict[str, tuple[list[int], list[float]]], title: str, path: Path) -> None:
    """One panel of :func:`round_series` as a PNG at ``path``."""
    _save(panel_figure(panel, curves, title), path)


def panel_figure(panel: str, curves: dict[str, tuple[list[int], list[float]]], title: str) -> Figure:
    """The figure of one panel of :func:`round_series`."""
    from matplotlib.figure import Figure  # here, not at import: about a second, and a run with no curve draws none
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 4), dpi=110)
    ax = fig.subplots()
    for label, (rounds, values) in curves.items():  # markers blot out a curve of many points
        ax.plot(rounds, values, marker="o" if len(rounds) <= MARKED_POINTS else None, markersize=3, label=label)
    ax.set_xlabel("round (of the global model scored)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # one round: no ticks at 0.95, 0.96, ...
    ax.set_ylabel(panel)
    values = [v for _, values in curves.values() for v in values]
    if panel == "accuracy":
        ax.set_ylim(*accuracy_limits(values))
    elif min(values) > 0 and max(values) > LOG_SPAN * min(values):  # a diverged round would flatten the others
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def _save(fig: Figure, path: Path) -> None:
    """``fig`` as a PNG at ``path``, whole or not at all (a full disk leaves no cut-off image)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def plot_label_counts(counts, path: Path, title: str = "") -> None:
    """A heat map of the examples of each class (x) each client (y) holds."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure registry
    from matplotlib.ticker import MaxNLocator

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
    _save(fig, path)
