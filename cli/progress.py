"""A per-round table printed as rounds finish (its last column the time left: the plain-line form of the progress),
and a progress bar on a terminal while the clients join and rounds run (the round, the last accuracy, the time
left)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, TextIO

COLUMNS = [("round", "{:>5}"), ("status", "{:>6}"), ("sampled", "{:>7}"), ("reported", "{:>8}"),
           ("late", "{:>4}"), ("train_loss", "{:>10.4f}"), ("test_accuracy", "{:>13.4f}"),
           ("upload_bytes", "{:>12,}"), ("round_seconds", "{:>13.2f}")]
PLAIN_EVERY = 10.0  # seconds between two plain lines of the clients joining (a log, not a terminal)
CLOCK_COLUMNS = [("sim_round_seconds", "{:>17.1f}"), ("sim_seconds", "{:>11.1f}")]  # under a virtual clock


class _Screen:
    """The terminal the bars and the table share: a bar is drawn or taken down, and a table line printed, under one
    lock, and a line is printed with every bar taken down (one thread draws the bar, another prints the rows)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.up: set[LiveBar] = set()  # the bars drawn now

    def line(self, text: str, stream: TextIO) -> None:
        """Print ``text`` on ``stream`` below the bars, each taken down first (the next update draws it again)."""
        with self.lock:
            for bar in list(self.up):
                bar.close()
            print(text, file=stream, flush=True)


SCREEN = _Screen()


def time_left(done: int, total: int, seconds: float) -> str:
    """The time left after ``done`` of ``total`` steps took ``seconds``, at their mean pace (e.g. ``1m05s``; ``?``
    before the first step is done)."""
    if done <= 0:
        return "?"
    left = max(0, round(seconds / done * (total - done)))
    return f"{left // 3600}h{left % 3600 // 60:02d}m" if left >= 3600 else \
        f"{left // 60}m{left % 60:02d}s" if left >= 60 else f"{left}s"


class RoundPace:
    """The rounds done in this process and when they ended, for the time left to ``total`` rounds."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic):
        self.total, self.clock, self.done, self.last_round = total, clock, 0, 0
        self.first_end: float | None = None  # when the first round this process saw ended

    def note(self, round_id: int) -> None:
        """Round ``round_id`` has ended."""
        if self.first_end is None:
            self.first_end = self.clock()
        self.done, self.last_round = self.done + 1, round_id

    def left(self) -> str:
        """The time left at the pace of the rounds since the first one ended here (the first one's time holds the
        start-up: loading the data, the clients joining, a resume's restore); "" until two rounds ended, as there is no
        pace to go by (a resumed run counts only its own rounds)."""
        to_go = max(0, self.total - self.last_round)
        if self.done and not to_go:
            return "0s"
        if self.done < 2:
            return ""
        return time_left(self.done - 1, self.done - 1 + to_go, self.clock() - self.first_end)


class RoundTable:
    """Prints a header once and a row per round: round, sampled, reported, late, loss, accuracy, seconds, and the
    time left to the last round (``left``)."""

    def __init__(self, total: int, stream: TextIO | None = None, quiet: bool = False,
                 columns: list[tuple[str, str]] | None = None):
        self.total, self.stream, self.quiet = total, sys.stdout if stream is None else stream, quiet
        self.columns = (COLUMNS if columns is None else columns) + [("left", "{}")]
        self.pace = RoundPace(total)
        self._header_done = False

    def row(self, metrics: dict) -> None:
        """Print one round's row."""
        self.pace.note(int(metrics.get("round") or 0))
        if self.quiet:
            return
        metrics = {**metrics, "left": self.pace.left()}
        if not self._header_done:
            SCREEN.line("  ".join(f"{name:>{self._width(name)}}" for name, _ in self.columns), self.stream)
            self._header_done = True
        cells = []
        for name, fmt in self.columns:
            width = self._width(name)
            value = metrics.get(name)
            text = "-" if value is None else (fmt.format(value).strip() if not isinstance(value, str) else value)
            if name == "round":
                text = f"{value}/{self.total}"
            cells.append(f"{text:>{width}}")
        SCREEN.line("  ".join(cells), self.stream)

    def _width(self, name: str) -> int:
        """A column's width: its name's, at least 5; the round's holds "1000/1000" (wider rows shifted the rest)."""
        return max(len(name), 5, 2 * len(str(self.total)) + 1 if name == "round" else 0)


class LiveBar:
    """A rich progress bar on a terminal: the clients registered until the first round starts, then the open round
    of all, its accepted uploads of K, the seconds left to its deadline, the last test accuracy and the time left to
    the last round, beside the table's line per round (:meth:`round_ended` takes the bar down before that line is
    printed). Elsewhere (a log, a pipe) the table's lines are the progress, and the clients joining show as a plain
    line on ``plain`` (the table's stream) when their count changed, at most every ``plain_every`` seconds."""

    def __init__(self, stream: TextIO | None = None, quiet: bool = False, total: int = 0,
                 plain: TextIO | None = None, plain_every: float = PLAIN_EVERY, traced: bool = False):
        self.stream, self.quiet = sys.stderr if stream is None else stream, quiet  # sys.stderr as it is now
        # with availability traces the count is of the clients online: "0 of 1 joining" hid that all had joined
        self.waiting = "clients online by their traces" if traced else "clients joining"
        self.plain, self.plain_every = sys.stdout if plain is None else plain, plain_every
        self.pace, self.accuracy = RoundPace(total), None
        self._joining_since, self._plain_said = None, (None, 0.0)  # when joining began; (count, when) last said
        self._progress = self._task = self._shown = None
        self._moved: list = []  # (log handler, its stream) while the bar is up
        self._ended = 0  # the last round that ended: follow() may have read it open just before, never drawn again

    def follow(self, coordinator) -> None:
        """Show where ``coordinator`` (a server.coordinator.Coordinator, its loop in another thread) is: the clients
        available (joined and online) of those a round needs, or the open round."""
        state = coordinator.current
        if state is None:  # the count its loop last saw: the registry itself is that loop's alone
            self.joining(coordinator.members.live_seen, coordinator.config.min_available)
        elif not state.closed:
            from fedpar.server.deadline import seconds_left
            self.round(state.round_id, state.accepted, state.target, seconds_left(state))

    def preparing(self, what: str) -> None:
        """Show a set-up step as it starts (``what``: e.g. loading the data): the bar's line on a terminal, a plain
        line elsewhere."""
        self._show(("prepare", what), what, 0, 1, "")
        if not self.quiet and not self.stream.isatty():
            print(f"{what} ...", file=self.plain, flush=True)

    def joining(self, registered: int, needed: int) -> None:
        """Show ``registered`` of ``needed`` clients joined."""
        self._show(("join",), self.waiting, registered, needed, "")
        if self.quiet or self.stream.isatty():
            return
        now = time.monotonic()
        if self._joining_since is None:  # the first line after plain_every seconds: a short start-up prints none
            self._joining_since, self._plain_said = now, (None, now)
        said, when = self._plain_said
        if registered != said and now - when >= self.plain_every:
            print(f"{self.waiting}: {registered:,} of {needed:,} ({now - self._joining_since:.0f} s)",
                  file=self.plain, flush=True)
            self._plain_said = (registered, now)

    def round(self, round_id: int, accepted: int, target: int, seconds_left: float) -> None:
        """Show round ``round_id``'s ``accepted`` uploads of ``target`` (K), the seconds left to its deadline, the
        last test accuracy and the time left to the last round."""
        total = f"/{self.pace.total}" if self.pace.total else ""
        left = self.pace.left()
        note = [f"deadline in {max(0.0, seconds_left):.0f} s"]
        note += [f"acc {self.accuracy:.4f}"] if self.accuracy is not None else []
        note += [f"{left} left"] if left else []  # none before two rounds ended: no pace to go by
        self._show(("round", round_id), f"round {round_id}{total}: uploads accepted", accepted, target,
                   ", ".join(note))

    def round_ended(self, metrics: dict) -> None:
        """Note a round's end (its test accuracy, the pace) and take the bar down before its table line."""
        with SCREEN.lock:
            self.pace.note(int(metrics.get("round") or 0))
            self._ended = max(self._ended, self.pace.last_round)
            if metrics.get("test_accuracy") is not None:
                self.accuracy = metrics["test_accuracy"]
            self.close()

    def _show(self, key: tuple, description: str, completed: int, total: int, note: str) -> None:
        if self.quiet or not self.stream.isatty():
            return
        with SCREEN.lock:
            if key[0] == "round" and key[1] <= self._ended:
                return
            if self._progress is None:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
                self._progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=10),
                                          MofNCompleteColumn(), TextColumn("{task.fields[note]}"),
                                          console=Console(file=self.stream), transient=True)
                self._progress.start()
                SCREEN.up.add(self)
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
        with SCREEN.lock:
            SCREEN.up.discard(self)
            if self._progress is not None:
                self._progress.stop()
                for handler, stream in self._moved:
                    handler.setStream(stream)
                self._progress = self._task = self._shown = None


class StepBar:
    """``fedpar train``'s progress: on a terminal a rich bar with the step (or epoch) of all, the last loss, the
    samples per second and the time left, with the trainer's lines printed above it; elsewhere (a log, a pipe) only
    those lines, which end with the time left. Holds nothing but its unit until it is used, so it crosses ``spawn`` to
    the rank that trains."""

    def __init__(self, unit: str = "step", stream: TextIO | None = None):
        self.unit, self._stream = unit, stream
        self._progress = self._task = None
        self._terminal: bool | None = None  # whether the stream is a terminal, decided at the first step

    @property
    def stream(self) -> TextIO:
        """Where the lines and the bar go (standard output unless given)."""
        return sys.stdout if self._stream is None else self._stream

    def line(self, message: str) -> None:
        """Print one of the trainer's lines (above the bar, while it is up)."""
        if self._progress is not None:
            self._progress.console.print(message, highlight=False, markup=False)
        else:
            print(message, file=self.stream, flush=True)

    def shows_steps(self) -> bool:
        """Whether the steps are shown (a bar on a terminal), decided once: while the bar is up, sys.stdout is rich's
        proxy, which is no terminal."""
        if self._terminal is None:
            self._terminal = self.stream.isatty()
        return self._terminal

    def step(self, done: int, total: int, note: str = "") -> None:
        """Show ``done`` of ``total`` steps, with ``note`` (the last loss, the speed) beside them."""
        if not self.shows_steps():
            return
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self._progress = Progress(TextColumn(f"{self.unit}s"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                      TextColumn("{task.fields[note]}"), TimeRemainingColumn(),
                                      console=Console(file=self.stream), transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.unit, total=total, completed=min(done, total), note=note)
        self._progress.update(self._task, completed=min(done, total), total=total, note=note)

    def close(self) -> None:
        """Take the bar down."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = self._task = None

    def tidy_after_ranks(self) -> None:
        """After the ranks that showed the bar were stopped by their launcher, which ends them before they can take
        it down: on a terminal, the bar's line cleared and the cursor (hidden while the bar was up) shown again."""
        if self.stream.isatty():
            self.stream.write("\r\x1b[2K\x1b[?25h")
            self.stream.flush()
