"""What a federated run leaves in its --out folder at the end, written one way for `fedpar simulate` and
`fedpar serve`: the global model, summary.json and the round plots, most valuable first."""

from __future__ import annotations

import importlib
import json
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fedpar.cli.user_errors import UserError
from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.model_file import INFO, TENSORS
from fedpar.server.final_model import write_coordinator_model

SUMMARY = "summary.json"
# The files a federated run (simulate, serve) may leave in its --out folder (the round plots: simulations/plots.py;
# labels.png: the runner's)
FEDERATED_FILES = ("metrics.jsonl", "metrics.csv", TENSORS, INFO, SUMMARY, "accuracy.png", "loss.png", "labels.png")
# fedpar train's (loss_curve.png: with --plot)
TRAIN_FILES = ("metrics.jsonl", "metrics.csv", TENSORS, INFO, SUMMARY, "loss_curve.png")
# Every file a run may leave in its --out folder
RUN_FILES = (*FEDERATED_FILES, "loss_curve.png")
# fedpar train's pointer to the checkpoint a resume starts from (parallel/checkpoint.py, epoch_checkpoint.py)
CHECKPOINT_POINTER = "checkpoints/latest"


def check_run_files(out, names: tuple[str, ...] = FEDERATED_FILES, option: str = "--out") -> None:
    """UserError, before a run starts, when something that is not a file (a folder) is where it writes one of
    ``names`` in ``out``: the run would find out only once it had trained, and lose the training."""
    for name in names:
        path = Path(out) / name
        if path.exists() and not path.is_file():  # a file is replaced, or set aside (EarlierRun); this cannot be
            what = "a folder" if path.is_dir() else "not a file"
            raise UserError(f"{option} {out}: {path}, a file the run writes, is {what}; move it away, "
                            f"or give another {option}")


@dataclass
class RunOutputs:
    """The summary of a run's rounds, and the files of its --out folder that hold what this run did."""

    summary: dict
    written: list[str] = field(default_factory=list)  # names in the folder, in the order written

    def wrote_line(self, out: Path) -> str:
        """'wrote OUT/a, b and c': the files this run left, and only those."""
        names = self.written
        if not names:
            return f"wrote nothing to {out}"
        return f"wrote {out}/{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else f"wrote {out}/{names[0]}"


class EarlierRun:
    """The files an earlier run left in ``out``, set aside (``OUT/.earlier-run``) while a new run that does not resume
    it starts: :meth:`restore` if the new run is refused or stopped before it writes a round (a refused command, or
    a Ctrl-C at start-up, loses nothing), else :meth:`drop` (it ran: its summary must not sit beside the other run's
    rows, model and plots): :meth:`settle` at its end chooses. ``OUT/checkpoints/latest`` (fedpar train's) goes with
    them: the earlier run stays resumable while the new run has written nothing, and no resume takes up its checkpoint
    beside the new run's rows."""

    FOLDER = ".earlier-run"
    KEPT = (*RUN_FILES, CHECKPOINT_POINTER)  # paths in ``out``
    # written in FOLDER once every file is set aside: a run killed before (between two moves) had not started, and
    # the earlier run's files still in ``out`` must not be taken for the new run's
    DONE = ".set-aside"

    def __init__(self, out: Path):
        self.out = Path(out)
        self.aside = self.out / self.FOLDER
        self.recover(self.out)
        self.names = []
        for name in self.KEPT:
            path = self.out / name
            if path.is_file():  # a folder in the way is no run's output: writing there says so (write_run_outputs)
                self._set_aside(name)
        if self.names:
            (self.aside / self.DONE).touch()

    @classmethod
    def recover(cls, out: Path) -> None:
        """The files a killed run left set aside back in ``out``, each where no file of its name is (they are the
        only copy of the run before it: one that had written a round had let them go); also for a run that resumes,
        and sets nothing aside. A run killed as it set them aside (no DONE) wrote nothing: the earlier run's files
        still in ``out`` are not its own."""
        aside = Path(out) / cls.FOLDER
        if not aside.is_dir():
            return
        # one that set them all aside and then wrote would have let them go, had it not been killed first
        if not (aside / cls.DONE).is_file() or not run_wrote(out):
            for name in cls.KEPT:
                kept = aside / name
                if kept.is_file() and not (Path(out) / name).exists():
                    _move(kept, Path(out) / name)
        shutil.rmtree(aside, ignore_errors=True)

    def _set_aside(self, name: str) -> None:
        """Move the earlier run's file ``name`` aside; UserError, with every file moved so far back in place, when it
        cannot be moved (a file this user may not move: the run could not replace it either)."""
        try:
            _move(self.out / name, self.aside / name)
        except OSError as exc:
            self.put_back()
            raise UserError(f"--out {self.out}: an earlier run's {name} there cannot be moved ({exc.strerror or exc}); "
                            "give another --out, or one whose files this user may replace") from None
        self.names.append(name)

    def put_back(self) -> None:
        """The earlier run's files back where they were (none of them was written again: the new run wrote no
        round)."""
        for name in self.names:
            if not (self.out / name).exists():
                _move(self.aside / name, self.out / name)
        self.drop()

    def restore(self) -> bool:
        """After a new run that wrote no round (refused, stopped or failed before one): the earlier run's files back,
        over what the new run wrote of its own (a summary of no round, which would sit beside them); with no earlier
        files, what the new run wrote stays. Whether there were earlier files (then the new run left nothing)."""
        restored = bool(self.names)
        if restored:
            for name in self.KEPT:
                if name in self.names:
                    _move(self.aside / name, self.out / name)
                elif (self.out / name).is_file():
                    (self.out / name).unlink()
        self.names = []
        self.drop()
        return restored

    def settle(self) -> bool:
        """At a run's end: the earlier run's files let go if this run wrote something of its own (:func:`run_wrote`:
        a round's row, a model, a checkpoint), else put back (:meth:`restore`); whether they were put back. Settling
        again does nothing."""
        if run_wrote(self.out):
            self.let_go()
            return False
        return self.restore()

    def let_go(self) -> None:
        """The new run wrote a round: the earlier run's files are forgotten, and :meth:`restore` leaves the new run's
        own."""
        self.names = []
        self.drop()

    def drop(self) -> None:
        """Forget the earlier run's files."""
        shutil.rmtree(self.aside, ignore_errors=True)


def _move(source: Path, target: Path) -> None:
    """Move the file ``source`` to ``target``, making the folder it goes into."""
    target.parent.mkdir(parents=True, exist_ok=True)
    source.replace(target)


def earlier_run_in(out: Path, resumes: bool) -> EarlierRun | None:
    """An earlier run's outputs in ``out``, set aside for a new run; None for a run that resumes a checkpoint (its rows
    go on), which first gets back what a run killed before it had set aside (:meth:`EarlierRun.recover`)."""
    if resumes:
        EarlierRun.recover(Path(out))
        return None
    return EarlierRun(Path(out))


def run_wrote(out: Path) -> bool:
    """Whether the run writing into ``out`` (an earlier run's files set aside) wrote something of its own: a metrics
    row, a model, or a checkpoint (``latest``: the earlier run's was set aside)."""
    metrics = Path(out) / "metrics.jsonl"
    return ((Path(out) / TENSORS).is_file() or (metrics.is_file() and metrics.stat().st_size > 0)
            or (Path(out) / CHECKPOINT_POINTER).is_file())


def import_plots_ahead() -> None:
    """Import the plots' module (matplotlib: about a second) on a thread of its own now, while the run starts, not
    after its last round (or a Ctrl-C)."""
    threading.Thread(target=importlib.import_module, args=("fedpar.simulations.plots",), daemon=True).start()


def write_run_outputs(out: Path, coordinator, model: dict, extra: dict, title: str,
                      more_plots: dict[str, Callable[[Path], None]] | None = None,
                      plots: bool | None = None) -> RunOutputs:
    """At the end of a run (also after Ctrl-C), in the order of what is worth most when the disk fills up or a
    plot fails: the coordinator's global model (OUT/global.safetensors and global.json, once a round completed;
    ``model`` says how to rebuild it), OUT/summary.json (what the rounds came to, from the metrics log's running
    summary, with the time to its target accuracy if it has one, then ``extra``), then, when a round completed,
    OUT/accuracy.png, loss.png (from metrics.jsonl, streamed) and ``more_plots`` (name: a function drawing that
    file).

    A run stopped by Ctrl-C (``extra["interrupted"]``, unless ``plots`` says otherwise) gets no plots: rendering
    them takes about a second on a busy machine, and Ctrl-C must stop a run within 2 s. ``plots`` True: a run that
    did not finish but was not stopped by a signal (a service's run stopped by 'fedpar run stop', or failed) gets
    them too.

    A file that cannot be written does not stop the ones after it; the first such OSError (naming that file, with
    a note of what was written) is raised once the rest are written.
    """
    out = Path(out)
    metrics = coordinator.metrics
    rounds = metrics.summary.rounds
    interrupted = bool(extra.get("interrupted"))
    summary = {**metrics.summary.result(), **extra}
    logged = [name for name in ("metrics.jsonl", "metrics.csv") if rounds and (out / name).is_file()]
    outputs = RunOutputs(summary, logged)
    failures: list[OSError] = []

    def attempt(name: str, write: Callable[[Path], object]) -> None:
        try:
            write(out / name)
        except OSError as exc:
            failures.append(exc)
        else:
            outputs.written.append(name)

    out.mkdir(parents=True, exist_ok=True)
    before = time.time()
    try:
        if write_coordinator_model(out, coordinator, model, interrupted):
            outputs.written += [TENSORS, INFO]
    except OSError as exc:  # global.safetensors may be written already, global.json not
        failures.append(exc)
        outputs.written += [name for name in (TENSORS, INFO) if _written_since(out / name, before)]
    attempt(SUMMARY, lambda path: atomic_write_bytes(path, [(json.dumps(summary, indent=2) + "\n").encode()]))
    if rounds and (not interrupted if plots is None else plots):
        from fedpar.simulations.plots import round_plots  # matplotlib (about a second) only once a curve is drawn

        rounds_drawn = round_plots(metrics.read_rows(), title) if metrics.path is not None else {}
        for name, draw in {**rounds_drawn, **(more_plots or {})}.items():
            attempt(name, draw)
    if failures:
        failures[0].add_note(outputs.wrote_line(out))
        raise failures[0]
    return outputs


def _written_since(path: Path, when: float) -> bool:
    """Whether ``path`` is a file written at or after ``when`` (not one left by an earlier run)."""
    try:
        return path.stat().st_mtime >= when - 1.0  # file-system timestamps may be coarser than time.time()
    except OSError:
        return False
