"""What a `fedpar simulate --checkpoint-dir` keeps of its run beside the checkpoints (DIR/run.json, written by
protocol/run_record.py): the settings it is made with, checked on a resume, and the seconds its processes ran."""

from __future__ import annotations

import json
import time
from pathlib import Path

from fedpar.protocol.model_file import INFO
from fedpar.protocol.run_record import RUN_RECORD, check_settings, record_settings, recorded_seconds
from fedpar.server.checkpoint import CheckpointError, has_checkpoint, latest_round, load_checkpoint
from fedpar.simulations.config import SimulationConfig
from fedpar.simulations.run_outputs import SUMMARY

AFRESH = "give another --checkpoint-dir to start afresh"
RECORD_SECONDS = 10.0  # a running simulation's seconds are recorded this often (each a durable write of run.json)


def check_resume(cfg: SimulationConfig) -> list[str]:
    """RunRecordError (a ValueError) when ``cfg`` would resume a checkpoint made for another federation
    (:meth:`SimulationConfig.resume_record`), CheckpointError when it would resume a damaged one; else one line for
    each setting the rounds after the checkpoint train with otherwise, or only one saying the checkpoint has every
    round done already (no round trains with what changed)."""
    done = latest_round(cfg.checkpoint_dir)
    if done is None:
        return []
    lines = check_settings(Path(cfg.checkpoint_dir) / RUN_RECORD, *cfg.resume_record(),
                           source=f"the checkpoint in {cfg.checkpoint_dir}", afresh=AFRESH)
    if not nothing_to_do(cfg):  # a damaged one is refused now, alone, not after these lines by the coordinator
        _check_loads(cfg.checkpoint_dir)
    if done >= cfg.rounds:
        kept = f" (its outputs are in {cfg.out} already)" if cfg.out and _outputs_of(Path(cfg.out), done) else ""
        return [f"the checkpoint in {cfg.checkpoint_dir} has every round done already (round {done}, --rounds "
                f"{cfg.rounds}): nothing to train{kept}; give --rounds above {done} to train on, or another "
                "--checkpoint-dir to start afresh"]
    return lines


def _check_loads(root: str) -> None:
    """CheckpointError, saying the resume cannot go on, when the latest checkpoint under ``root`` is damaged."""
    try:
        load_checkpoint(Path(root))
    except CheckpointError as exc:
        raise CheckpointError(f"cannot resume: {exc}") from None


def nothing_to_do(cfg: SimulationConfig) -> bool:
    """Whether ``cfg`` resumes a checkpoint with every round done whose outputs its --out holds already (the model
    and summary the run wrote after that round, not after a Ctrl-C): then no process need start. Into another --out
    the run still starts, to write them there from the checkpoint."""
    done = latest_round(cfg.checkpoint_dir) if cfg.checkpoint_dir is not None else None
    return done is not None and done >= cfg.rounds and (not cfg.out or _outputs_of(Path(cfg.out), done))


def _outputs_of(out: Path, round_id: int) -> bool:
    """Whether ``out`` holds a finished run's outputs of round ``round_id`` (its global.json and summary.json)."""
    try:
        info = json.loads((out / INFO).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("round") == round_id and info.get("interrupted") is False and \
        (out / SUMMARY).is_file()


class RunRecord:
    """A --checkpoint-dir's record of the settings its checkpoints are made with, and of the seconds the run's
    processes ran (DIR/run.json). It is kept only once the coordinator has resumed the checkpoint (or started
    afresh): a resume refused there (another strategy, another model, a damaged checkpoint) leaves the record as it
    was, and the next resume compares with what the rounds really ran with."""

    def __init__(self, cfg: SimulationConfig):
        self.cfg = cfg
        # the seconds the processes before this one ran the run this one resumes (0: it starts afresh)
        self.earlier = recorded_seconds(Path(cfg.checkpoint_dir) / RUN_RECORD) \
            if has_checkpoint(cfg.checkpoint_dir) else 0.0
        self.kept = False
        self._updated_at = time.monotonic()

    def keep(self, seconds_here: float = 0.0) -> None:
        """Record the settings (checked already: :func:`check_resume`, and the coordinator's resume) and the run's
        seconds, ``seconds_here`` of them in this process. A checkpoint of older code, which kept no record, is left
        without one: what it was made with is not known, and recording these would vouch for them."""
        if self.cfg.checkpoint_dir is None:
            return
        root = Path(self.cfg.checkpoint_dir)
        if latest_round(root) is not None and not (root / RUN_RECORD).is_file():
            return
        record_settings(root / RUN_RECORD, *self.cfg.resume_record(), seconds=self.earlier + seconds_here)
        self.kept = True

    def update(self, seconds_here: float) -> None:
        """The run's seconds again, however this process's part ended, if the record was kept (:meth:`keep`)."""
        if self.kept:
            self.keep(seconds_here)
            self._updated_at = time.monotonic()

    def update_now_and_then(self, seconds_here: float) -> None:
        """:meth:`update`, at most every RECORD_SECONDS (each a durable write): a process killed outright (kill -9)
        leaves the run's seconds counted up to then, not to its start."""
        if time.monotonic() - self._updated_at >= RECORD_SECONDS:
            self.update(seconds_here)