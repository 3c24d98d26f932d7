"""A per-round table printed as rounds finish, and a progress bar while the clients join and rounds run."""

from __future__ import annotations

import logging
import sys
import threading
import time
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


class LiveBar:
    """A rich progress bar on a terminal only (a log or a pipe gets nothing from it, so its output is unchanged):
    the clients registered until the first round starts, then the open round's accepted uploads of K and the time
    left to its deadline, beside the table's line per round (:meth:`close` before that line is printed)."""

    def __init__(self, stream: TextIO = sys.stderr, quiet: bool = False):
        self.stream, self.quiet = stream, quiet
        self._progress = self._task = self._shown = None
        self._moved: list = []  # (log handler, its stream) while the bar is up
        self._lock = threading.Lock()  # updated by the caller's loop, closed by the round callbacks' thread

    def follow(self, coordinator) -> None:
        """Show where ``coordinator`` (a server.coordinator.Coordinator) is: joining, or the open round."""
        state = coordinator.current
        if state is None:
            self.joining(len(coordinator.registry), coordinator.config.min_available)
        elif not state.closed:
            left = state.deadline_seconds - (time.monotonic() - state.started)
            self.round(state.round_id, state.accepted, state.target, left)

    def joining(self, registered: int, needed: int) -> None:
        """Show ``registered`` of ``needed`` clients joined."""
        self._show(("join",), "clients joining", registered, needed, "")

    def round(self, round_id: int, accepted: int, target: int, seconds_left: float) -> None:
        """Show round ``round_id``'s ``accepted`` uploads of ``target`` (K) and the seconds left to its deadline."""
        self._show(("round", round_id), f"round {round_id}: uploads accepted", accepted, target,
                   f"deadline in {max(0.0, seconds_left):.0f} s")

    def _show(self, key: tuple, description: str, completed: int, total: int, note: str) -> None:
        if self.quiet or not self.stream.isatty():
            return
        with self._lock:
            if self._progress is None:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
                self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                          TextColumn("{task.fields[note]}"), TimeElapsedColumn(),
                                          console=Console(file=self.stream), transient=True)
                self._progress.start()
                # Log lines (serve logs to stderr) go above the bar through rich's proxy, not across it.
                self._moved = [(h, h.setStream(sys.stderr)) for h in logging.getLogger().handlers
                               if type(h) is logging.StreamHandler and h.stream in (self.stream, sys.__stderr__)]
            if key != self._shown:  # a new phase or round: its own bar and elapsed time
                if self._task is not None:
                    self._progress.remove_task(self._task)
                self._task, self._shown = self._progress.add_task(description, total=total, note=note), key
            self._progress.update(self._task, description=description, completed=min(completed, total), total=total,
                                  note=note)

    def close(self) -> None:
        """Take the bar down (before a line is printed below it)."""
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
                for handler, stream in self._moved:
                    handler.setStream(stream)
                self._progress = self._task = self._shown = None
