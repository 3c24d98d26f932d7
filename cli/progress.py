"""A per-round table printed as rounds finish, and a progress bar while the clients join."""

from __future__ import annotations

import sys
from typing import TextIO

COLUMNS = [("round", "{:>5}"), ("status", "{:>6}"), ("sampled", "{:>7}"), ("reported", "{:>8}"),
           ("late", "{:>4}"), ("train_loss", "{:>10.4f}"), ("test_accuracy", "{:>13.4f}"),
           ("upload_bytes", "{:>12,}"), ("round_seconds", "{:>13.2f}")]
CLOCK_COLUMNS = [("sim_round_seconds", "{:>17.1f}"), ("sim_seconds", "{:>11.1f}")]  # under a virtual clock


class RoundTable:
    """Prints a header once and a row per round: round, sampled, reported, late, loss, accuracy, seconds."""

    def __init__(self, total: int, stream: TextIO = sys.stdout, quiet: bool = False,
                 columns: list[tuple[str, str]] | None = None):
        self.total, self.stream, self.quiet = total, stream, quiet
        self.columns = COLUMNS if columns is None else columns
        self._header_done = False

    def row(self, metrics: dict) -> None:
        """Print one round's row."""
        if self.quiet:
            return
        if not self._header_done:
            print("  ".join(f"{name:>{max(len(name), 5)}}" for name, _ in self.columns), file=self.stream)
            self._header_done = True
        cells = []
        for name, fmt in self.columns:
            width = max(len(name), 5)
            value = metrics.get(name)
            text = "-" if value is None else (fmt.format(value).strip() if not isinstance(value, str) else value)
            if name == "round":
                text = f"{value}/{self.total}"
            cells.append(f"{text:>{width}}")
        print("  ".join(cells), file=self.stream, flush=True)


class JoiningBar:
    """A rich progress bar of the clients registered until the first round starts (on a terminal only: a log or a
    pipe gets the one line the first round's row follows)."""

    def __init__(self, stream: TextIO = sys.stderr, quiet: bool = False):
        self.stream, self.quiet = stream, quiet
        self._progress = self._task = None

    def update(self, registered: int, needed: int) -> None:
        """Show ``registered`` of ``needed`` clients joined."""
        if self.quiet or not self.stream.isatty():
            return
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self._progress = Progress(TextColumn("clients joining"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(file=self.stream), transient=True)
            self._task = self._progress.add_task("join", total=needed)
            self._progress.start()
        self._progress.update(self._task, completed=min(registered, needed), total=needed)

    def close(self) -> None:
        """Take the bar down."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
