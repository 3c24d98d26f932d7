"""A real `fedpar simulate --checkpoint-dir` resumed with settings that make another federation (clients, partition,
seed, examples per client, validation share, dataset) is refused in one line before any worker starts, naming each
difference; one that only trains on otherwise (--lr) is said in one line and resumed; a checkpoint with every round
done says so; a checkpoint of older code, which kept no record of its settings, resumes as before."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedpar.cli.main import main
from support.in_process import logging_as_a_fresh_process, run_main

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--dataset", "digits", "--clients-per-round", "2", "--local-epochs", "1", "--seed", "7", "--workers", "1",
          "--seats", "1", "--quiet", "--no-plot"]


def _argv(*extra: str, out: Path, ckpt: Path, clients: int, rounds: int) -> list[str]:
    return ["simulate", *COMMON, "--clients", str(clients), "--rounds", str(rounds), *extra, "--out", str(out),
            "--checkpoint-dir", str(ckpt)]


def _simulate(*extra: str, out: Path, ckpt: Path, capfd, clients: int = 4, rounds: int = 2) -> tuple[int, str]:
    """The command by its main in this process (support.in_process.run_main: its exit code and its stderr, the
    workers' included, as a process's), its workers started with OMP_NUM_THREADS=1 as before."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        done = run_main(_argv(*extra, out=out, ckpt=ckpt, clients=clients, rounds=rounds), capfd, ROOT)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stderr


def _refused(*extra: str, out: Path, ckpt: Path, clients: int, rounds: int, capsys) -> tuple[int, str]:
    """The command in this process: a refusal comes before the child process (and any worker) would start, so the
    command's code and stderr are the same as a process's, without the process's seconds of imports."""
    capsys.readouterr()
    code = main(_argv(*extra, out=out, ckpt=ckpt, clients=clients, rounds=rounds))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def _rounds(out: Path) -> list[int]:
    return [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A run of 2 rounds on 4 clients, with its checkpoints and its outputs."""
    base = tmp_path_factory.mktemp("made")
    with pytest.MonkeyPatch.context() as mp, logging_as_a_fresh_process():  # its main in this process, as _simulate
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.chdir(ROOT)
        assert main(_argv(out=base / "out", ckpt=base / "ckpt", clients=4, rounds=2)) == 0
    return base


@pytest.fixture
def run(made, tmp_path) -> Path:
    """A copy of the run, to resume."""
    shutil.copytree(made, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("extra, clients, difference", [
    ((), 6, "--clients 4, not 6"),
    (("--partition", "dirichlet:0.5"), 4, "--partition auto, not dirichlet:0.5"),
    (("--seed", "8"), 4, "--seed 7, not 8"),
    (("--examples-per-client", "20"), 4, "--examples-per-client (not given), not 20"),
    (("--val-fraction", "0.2"), 4, "--val-fraction 0.1, not 0.2"),
    (("--dataset", "synthetic"), 4, "--dataset digits, not synthetic"),
])
def test_a_resume_of_another_federation_is_refused_in_one_line_before_any_worker_starts(run, extra, clients,
                                                                                         difference, capsys):
    before = (run / "ckpt" / "LATEST").read_text()
    code, err = _refused(*extra, out=run / "out", ckpt=run / "ckpt", clients=clients, rounds=4, capsys=capsys)
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert difference in err and f"cannot resume from the checkpoint in {run / 'ckpt'}" in err, err
    assert "--checkpoint-dir to start afresh" in err, err
    assert (run / "ckpt" / "LATEST").read_text() == before
    assert _rounds(run / "out") == [1, 2]  # no round of another federation joined them


def test_every_difference_is_named_at_once(run, capsys):
    code, err = _refused("--seed", "9", out=run / "out", ckpt=run / "ckpt", clients=5, rounds=4, capsys=capsys)
    assert code == 2 and "--seed 7, not 9; --clients 4, not 5;" in err, err


def test_a_checkpoint_with_every_round_done_says_so(run, capfd):
    for rounds in (2, 1):  # in this process (its child, which finds every round done, says so on the same stderr)
        capfd.readouterr()
        code = main(_argv(out=run / "out", ckpt=run / "ckpt", clients=4, rounds=rounds))
        err = capfd.readouterr().err
        assert code == 0 and "Traceback" not in err, err
        line = [line for line in err.splitlines() if "every round done already" in line]
        assert len(line) == 1 and f"(round 2, --rounds {rounds}): nothing to train" in line[0], err
    assert _rounds(run / "out") == [1, 2]


def test_the_same_federation_resumes_and_another_lr_is_said_once(made, run, capfd):
    # into another --out folder: it starts with the run's earlier rows (it held only those from round 3 on)
    code, err = _simulate("--lr", "0.05", out=run / "moved", ckpt=run / "ckpt", rounds=3, capfd=capfd)
    assert code == 0, err
    assert err.splitlines() == [f"fedpar simulate: resuming the checkpoint in {run / 'ckpt'} with --lr 0.05; its "
                                "last session went with --lr 0.1"], err
    assert _rounds(run / "moved") == [1, 2, 3]
    first, resumed = _summary(made / "out"), _summary(run / "moved")
    # the whole run's seconds: the first process's (kept in the record) and this one's
    assert resumed["earlier_processes_seconds"] >= first["wall_seconds"] > 0
    assert resumed["wall_seconds"] > resumed["earlier_processes_seconds"]
    code, err = _simulate("--lr", "0.05", out=run / "moved", ckpt=run / "ckpt", rounds=4, capfd=capfd)
    assert code == 0 and err == "", err  # the record now says what round 3 ran with
    assert _rounds(run / "moved") == [1, 2, 3, 4]
    assert _summary(run / "moved")["earlier_processes_seconds"] >= resumed["wall_seconds"]


def test_a_resume_the_coordinator_refuses_leaves_the_record_as_the_rounds_ran(run, capfd):
    """A resume with another --lr and another --strategy: the strategy's refusal came after the record took the new
    --lr, so the next resume said "its run so far went with --lr 0.05", which no round ran with (QA)."""
    record = (run / "ckpt" / "run.json").read_text()
    code, err = _simulate("--lr", "0.05", "--strategy", "fedadam", out=run / "out", ckpt=run / "ckpt", rounds=3,
                          capfd=capfd)
    assert code == 2 and "was made with strategy 'fedavg', not 'fedadam'" in err, err
    assert (run / "ckpt" / "run.json").read_text() == record
    code, err = _simulate("--lr", "0.05", out=run / "out", ckpt=run / "ckpt", rounds=3, capfd=capfd)
    assert code == 0 and "its last session went with --lr 0.1" in err, err


def test_a_resume_names_a_changed_setting_by_the_flag_and_word_the_user_gives(run, capfd):
    """It said "--upload-compression {...}", not a flag's value (and "--clock true", which a resume now refuses:
    test_a_resume_on_another_clock_is_refused_naming_the_clock_the_run_used says it by its word)."""
    code, err = _simulate("--compression", "int8", out=run / "out", ckpt=run / "ckpt", rounds=3, capfd=capfd)
    assert code == 0, err
    assert err.splitlines() == [f"fedpar simulate: resuming the checkpoint in {run / 'ckpt'} with --compression int8; "
                                "its last session went with --compression none"], err


def _sim_seconds(out: Path) -> list[float]:
    return [json.loads(line)["sim_seconds"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_resume_on_another_clock_is_refused_naming_the_clock_the_run_used(run, capsys):
    """A real-clock run resumed with --clock virtual counted sim_seconds from 0 at round 3, as if rounds 1 and 2 took
    no time; the clock is the run's, as its clients are."""
    record = (run / "ckpt" / "run.json").read_text()
    code, err = _refused("--clock", "virtual", out=run / "out", ckpt=run / "ckpt", clients=4, rounds=3, capsys=capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"cannot resume from the checkpoint in {run / 'ckpt'}: it was made with --clock real, not virtual; run " \
           "with those settings to resume it, or give another --checkpoint-dir to start afresh" in err, err
    assert (run / "ckpt" / "run.json").read_text() == record
    assert _rounds(run / "out") == [1, 2]


def test_a_virtual_clock_run_resumes_on_its_clock_only_and_counts_its_simulated_time_on(tmp_path, capfd):
    """Resumed with --clock real, its summary kept round 2's sim_seconds for a run of 3 rounds; now that is refused,
    and on its own clock round 3 goes on from round 2's simulated time."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    code, err = _simulate("--clock", "virtual", out=out, ckpt=ckpt, rounds=2, capfd=capfd)
    assert code == 0, err
    first = _sim_seconds(out)
    code, err = _simulate("--clock", "real", out=out, ckpt=ckpt, rounds=3, capfd=capfd)
    assert code == 2 and len(err.splitlines()) == 1 and "made with --clock virtual, not real" in err, err
    assert _rounds(out) == [1, 2]
    code, err = _simulate("--clock", "virtual", out=out, ckpt=ckpt, rounds=3, capfd=capfd)
    assert code == 0 and err == "", err
    seconds = _sim_seconds(out)
    assert seconds[:2] == first and 0 < first[0] < first[1] < seconds[2]
    assert _summary(out)["sim_seconds"] == seconds[2]


def test_a_record_of_older_code_that_only_noted_the_clock_refuses_another(tmp_path):
    """A run.json written while --clock was only noted keeps it among the noted settings: a resume on another clock
    is refused all the same."""
    from fedpar.protocol.run_record import RunRecordError, check_settings, record_settings

    record_settings(tmp_path / "run.json", {"--clients": 4}, {"--clock": "virtual", "--lr": 0.1})
    with pytest.raises(RunRecordError, match="it was made with --clock virtual, not real;"):
        check_settings(tmp_path / "run.json", {"--clients": 4, "--clock": "real"}, {"--lr": 0.1}, source="it",
                       afresh="start afresh")
    assert check_settings(tmp_path / "run.json", {"--clients": 4, "--clock": "virtual"}, {"--lr": 0.1}, source="it",
                          afresh="start afresh") == []


def test_a_resume_of_a_private_run_names_the_privacy_flag_it_changes(tmp_path, capfd):
    """It said '--strategy-option {"noise_multiplier": 0.5, "clip_norm": 1.0, ...}', a flag the user never gave."""
    private = ("--privacy", "central", "--privacy-noise", "0.3")
    code, err = _simulate(*private, out=tmp_path / "out", ckpt=tmp_path / "ckpt", rounds=1, capfd=capfd)
    assert code == 0, err
    code, err = _simulate(*private[:3], "0.5", out=tmp_path / "out", ckpt=tmp_path / "ckpt", rounds=2, capfd=capfd)
    assert code == 0, err
    assert err.splitlines() == [f"fedpar simulate: resuming the checkpoint in {tmp_path / 'ckpt'} with --privacy-noise "
                                "0.5; its last session went with --privacy-noise 0.3"], err


def test_a_fresh_checkpoint_folder_records_the_new_federation(run, capfd):
    code, err = _simulate(out=run / "other", ckpt=run / "fresh", clients=6, rounds=1, capfd=capfd)
    assert code == 0, err
    assert json.loads((run / "fresh" / "run.json").read_text())["defining"]["--clients"] == 6


def test_a_fresh_run_into_an_earlier_runs_out_that_stops_before_round_1_keeps_the_earlier_outputs(run):
    kept = {p.name: p.read_bytes() for p in (run / "out").iterdir() if p.is_file()}
    assert "global.safetensors" in kept and "summary.json" in kept
    cmd = [sys.executable, "-m", "fedpar.cli.main", "simulate", *[a for a in COMMON if a != "--quiet"], "--clients",
           "6", "--rounds", "2", "--out", str(run / "out")]  # no checkpoint: a fresh run
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the data loads once the run has started its outputs: before any worker joins
            if line.startswith("loading digits"):
                proc.send_signal(signal.SIGINT)
                break
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err, err
    # the 4-client run's rows, model, plots and summary are back as they were, and nothing of this one beside them
    assert sorted(p.name for p in (run / "out").iterdir()) == sorted(kept), err
    assert all((run / "out" / name).read_bytes() == data for name, data in kept.items())


def test_a_checkpoint_of_older_code_without_its_record_still_resumes(run, capfd):
    (run / "ckpt" / "run.json").unlink()
    code, err = _simulate(out=run / "out", ckpt=run / "ckpt", clients=5, rounds=3, capfd=capfd)
    assert code == 0, err
    assert _rounds(run / "out") == [1, 2, 3]
    assert not (run / "ckpt" / "run.json").exists()  # what it was made with is still not known


def test_every_simulate_setting_is_recorded_for_a_resume_or_left_out_on_purpose():
    """A new setting must say whether a resume that changes it is refused, said, or neither (the guide's recipe):
    where it is declared, setting(resume=...)."""
    from dataclasses import fields

    from fedpar.settings import DEFINES, NOTED, RESUME, UNRECORDED
    from fedpar.simulations.config import SimulationConfig, flag_of

    roles = {f.name: f.metadata.get(RESUME) for f in fields(SimulationConfig)}
    unsaid = sorted(name for name, role in roles.items() if role not in (DEFINES, NOTED, UNRECORDED))
    assert not unsaid, f"declare each with setting(resume=DEFINES, NOTED or UNRECORDED): {unsaid}"
    defining, noted = SimulationConfig().resume_record()
    for name, role in roles.items():  # the record keeps each as declared, by its flag
        flag = flag_of(SimulationConfig, name) if name != "upload_compression" else "--compression"
        assert (flag in defining, flag in noted) == (role == DEFINES, role == NOTED), (name, role)


def test_a_private_secure_run_with_a_flower_strategy_resumes_where_it_stopped(tmp_path, capfd):
    """QA: a checkpoint of --strategy flower:FedAdam --privacy client --secure-aggregation (strategy
    'dp-flower:FedAdam') was refused on resume, "unknown strategy 'dp-flower:FedAdam'": the check of the resumed
    strategy took dp-flower:REF for a registered name. It resumes: epsilon grows on, and the adaptive clip norm and
    FedAdam's moments are the checkpoint's."""
    private = ("--strategy", "flower:FedAdam", "--secure-aggregation", "--privacy", "client", "--privacy-clip", "0.5",
               "--privacy-noise", "0.3", "--privacy-adaptive-quantile", "0.5")
    ckpt = tmp_path / "ckpt"
    code, err = _simulate(*private, out=tmp_path / "out", ckpt=ckpt, rounds=1, capfd=capfd)
    assert code == 0, err
    saved = json.loads((ckpt / "round-000001" / "state.json").read_text())["strategy"]
    assert saved["strategy"] == "dp-flower:FedAdam" and {"m_t", "v_t"} <= set(saved["inner"]["flower_records"])
    code, err = _simulate(*private, out=tmp_path / "out", ckpt=ckpt, rounds=2, capfd=capfd)
    assert code == 0 and err == "", err
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows)
    assert rows[1]["dp_epsilon"] > rows[0]["dp_epsilon"] > 0
    assert rows[1]["dp_clip_norm"] == pytest.approx(saved["clip_norm"]) != 0.5  # the clip norm round 1 adapted to
    code, err = _simulate("--strategy", "flower:FedAvg", *private[2:], out=tmp_path / "out", ckpt=ckpt, rounds=3,
                          capfd=capfd)
    assert code == 2 and "made with strategy 'dp-flower:FedAdam', not 'dp-flower:FedAvg'" in err, err


def test_a_running_simulation_records_its_seconds_now_and_then(tmp_path, monkeypatch):
    """A coordinator killed outright (kill -9) writes no end: its seconds are in run.json up to the last update
    (QA: a resume after a kill counted 0.22 s of about 5 s before it)."""
    from fedpar.protocol.run_record import recorded_seconds
    from fedpar.simulations import resume
    from fedpar.simulations.config import SimulationConfig

    record = resume.RunRecord(SimulationConfig(clients=4, rounds=3, checkpoint_dir=str(tmp_path / "ckpt")))
    record.keep(0.5)
    record.update_now_and_then(3.0)  # within RECORD_SECONDS of the last write: none
    assert recorded_seconds(tmp_path / "ckpt" / "run.json") == 0.5
    monkeypatch.setattr(resume, "RECORD_SECONDS", 0.0)
    record.update_now_and_then(4.0)
    assert recorded_seconds(tmp_path / "ckpt" / "run.json") == 4.0


def test_a_resume_note_says_an_empty_table_of_options_as_not_given(tmp_path):
    """It said '--strategy-option {}' of a run given none (QA)."""
    from fedpar.protocol.run_record import check_settings, record_settings

    record_settings(tmp_path / "run.json", {"--clients": 4}, {"--strategy-option": {}})
    lines = check_settings(tmp_path / "run.json", {"--clients": 4}, {"--strategy-option": {"mu": 0.1}}, source="it",
                           afresh="start afresh")
    assert len(lines) == 1 and "(not given)" in lines[0] and "{}" not in lines[0], lines
