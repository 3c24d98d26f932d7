"""`fedpar simulate` refuses a user's mistake found as the run starts in one line, exit 2, with no --debug hint (QA:
an --out it could not make and a trace with too few clients online exited 1 with the hint), launched or not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.in_process import run_main as run_main

SIMULATE = [sys.executable, "-m", "fedpar", "simulate", "--clients", "20", "--clients-per-round", "5", "--rounds",
            "2", "--quiet", "--no-plot"]
# the same command run by fedpar's main in the test's process: a refusal's one line and exit code, and a run's
# outputs, are what these tests prove, not the process boundary (the kill -9 below keeps its own process)
SIMULATE_HERE = SIMULATE[3:]
LAUNCHED = {"here": [], "in a child (--checkpoint-dir)": ["--checkpoint-dir", "ckpt"]}


def _trace(path) -> str:
    """Each of 20 clients online one hour a day, one after the other: at most 2 online at once."""
    rows = ["client,seconds_per_step,download_mbps,upload_mbps,available_from,available_for"]
    rows += [f"{i},0.01,10,5,{i * 3600},3600" for i in range(20)]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def _refused(args: list[str], cwd, capfd) -> str:
    done = run_main(SIMULATE_HERE + args, capfd, cwd)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "--debug" not in lines[0], done.stderr
    return lines[0]


@pytest.mark.parametrize("where", LAUNCHED)
def test_an_out_folder_that_cannot_be_made_is_refused_in_one_line(where, tmp_path, capfd):
    line = _refused(["--out", "/proc/nope", *LAUNCHED[where]], tmp_path, capfd)
    assert line.startswith("fedpar simulate: --out /proc/nope: cannot make the folder: No such file or directory"), line


def test_a_trace_with_too_few_clients_online_is_refused_in_one_line(tmp_path, capfd):
    line = _refused(["--trace", _trace(tmp_path / "t.csv"), "--clock", "virtual", "--out", str(tmp_path / "o")],
                    tmp_path, capfd)
    assert "at most 2 of the 20 clients were online at once" in line and "a round needs 5" in line, line


FLOWER_CLASS = '''
from flwr.server.strategy import FedAvg


class Scaled(FedAvg):
    def __init__(self, factor: float, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor
'''


@pytest.mark.parametrize("args, says", [
    ([], "Scaled needs 'factor' (no default); give --strategy-option factor=VALUE"),
    (["--strategy-option", "nosuch=1"], "unknown option 'nosuch' for strategy 'flower:scaled.py:Scaled'; valid "
                                        "options: factor (float, required)"),
])
def test_a_flower_class_whose_argument_is_missing_or_mistyped_says_how_to_give_it(args, says, tmp_path, capfd):
    """QA: a required constructor argument was listed as 'default <class 'inspect._empty'>', and leaving it out said
    Python's 'missing a required argument' with no flag to give it by."""
    pytest.importorskip("flwr")
    (tmp_path / "scaled.py").write_text(FLOWER_CLASS)
    line = _refused(["--strategy", "flower:scaled.py:Scaled", *args, "--out", str(tmp_path / "o")], tmp_path, capfd)
    assert line.endswith(says), line
    assert not (tmp_path / "o").exists()


def test_a_flower_class_needing_an_object_says_no_option_can_give_it(tmp_path, capfd):
    pytest.importorskip("flwr")
    line = _refused(["--strategy", "flower:flwr.server.strategy:DifferentialPrivacyServerSideFixedClipping"],
                    tmp_path, capfd)
    assert "needs 'strategy', which no --strategy-option can give" in line and "a subclass of your own" in line, line


NEGATIVE_MU = '''
from flwr.server.strategy import FedAvg


class NegativeMu(FedAvg):
    def configure_fit(self, server_round, parameters, client_manager):
        pairs = super().configure_fit(server_round, parameters, client_manager)
        for _, fit in pairs:
            fit.config["proximal_mu"] = -0.5
        return pairs
'''


def test_a_negative_proximal_mu_of_a_flower_strategy_is_one_line_with_no_traceback(tmp_path, capfd):
    """QA: --strategy flower:...:FedProx --strategy-option proximal_mu=-1 started the run, then logged 'coordinator
    stopped with an error' and a traceback at round 1: it is refused before anything starts; a strategy whose own
    configure_fit asks for one stops the run in one line naming it."""
    pytest.importorskip("flwr")
    for strategy in ("flower:flwr.server.strategy:FedProx", "flower:FedProx"):  # Flower's two APIs
        line = _refused(["--strategy", strategy, "--strategy-option", "mu=-1"], tmp_path, capfd)
        assert line == f"fedpar simulate: option 'proximal_mu' of {strategy} must be >= 0, got -1.0", line
    (tmp_path / "negative_mu.py").write_text(NEGATIVE_MU)
    done = run_main(SIMULATE_HERE + ["--strategy", "flower:negative_mu.py:NegativeMu", "--out", "o"], capfd, tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == ["fedpar simulate: round 1: flower:negative_mu.py:NegativeMu's configure_fit "
                                        "config: proximal_mu must be >= 0, got -0.5; fix the strategy"], done.stderr


def test_a_flower_option_value_its_constructor_refuses_is_a_mistake_said_before_the_rounds(tmp_path, capfd):
    """QA: FedTrimmedAvg's beta=0.9 ran until round 1 built the strategy, then exited 1 with 'fix the strategy'."""
    pytest.importorskip("flwr")
    line = _refused(["--strategy", "flower:flwr.server.strategy:FedTrimmedAvg", "--strategy-option", "beta=0.9",
                     "--out", str(tmp_path / "o")], tmp_path, capfd)
    assert line == ("fedpar simulate: flower:flwr.server.strategy:FedTrimmedAvg refused its options: `beta` must be in "
                    "the range [0, 0.5). (check --strategy-option)"), line
    assert not (tmp_path / "o").exists()
    # the constructor tried on the options says nothing: Flower's own note on its options comes once, at the build
    said = [word for word in SIMULATE_HERE if word != "--quiet"]  # --quiet keeps Flower's notes quiet throughout
    done = run_main(said + ["--strategy", "flower:FedProx", "--strategy-option", "mu=0", "--out", "o"], capfd,
                    tmp_path)
    assert done.returncode == 0 and (done.stdout + done.stderr).count("proximal_mu=0.0") == 1, done.stderr


@pytest.fixture
def immutable():
    """``chattr +i`` on the paths given (skips where it cannot: not root, or a file system without the flag);
    undone afterwards."""
    import shutil

    made = []

    def make(path):
        if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
            pytest.skip("chattr +i is not available here")
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=False)


@pytest.mark.parametrize("where", LAUNCHED)
def test_an_earlier_runs_file_that_cannot_be_moved_is_one_line_and_the_folder_is_left_as_it_was(where, tmp_path,
                                                                                                  immutable, capfd):
    """QA: a run whose --out held an earlier run's summary.json it could not move exited 1 with the --debug hint,
    and left that run's metrics, model and plots moved away into OUT/.earlier-run."""
    made = run_main(SIMULATE_HERE + ["--out", "o"], capfd, tmp_path)
    assert made.returncode == 0, made.stderr
    before = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()}
    immutable(tmp_path / "o" / "summary.json")
    line = _refused(["--out", "o", *LAUNCHED[where]], tmp_path, capfd)
    assert line == ("fedpar simulate: --out o: an earlier run's summary.json there cannot be moved (Operation not "
                    "permitted); give another --out, or one whose files this user may replace"), line
    assert {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()} == before


def test_an_out_folder_that_cannot_be_written_is_not_said_to_be_unmade(tmp_path, immutable, capfd):
    """QA: an --out folder that was there but could not be written in read 'cannot make the folder'."""
    (tmp_path / "o").mkdir()
    immutable(tmp_path / "o")
    line = _refused(["--out", "o"], tmp_path, capfd)
    assert line == ("fedpar simulate: --out o: cannot write in the folder: Operation not permitted; give a folder this "
                    "user can write"), line


def _wait_until_free(out, timeout: float = 60.0) -> None:
    """Wait until no process holds the lock on folder ``out``: the killed run's workers hold it until the kernel has
    ended them too, a moment after its own process (a run started here at once is refused as a second run into it)."""
    import time

    from fedpar.cli.user_errors import OUTPUT_LOCK
    from fedpar.protocol.file_lock import LockHeld, check_free

    lock = out / OUTPUT_LOCK
    deadline = time.monotonic() + timeout
    while True:
        try:
            check_free(lock)
            return
        except LockHeld:
            assert time.monotonic() < deadline, f"{lock} still held {timeout} s after the kill"
            time.sleep(0.02)


def _fresh_run_killed_before_its_first_round(cwd) -> None:
    """A fresh run into ``cwd``/o, killed (kill -9 of its process group) once its workers joined: the files of the run
    before it are set aside in OUT/.earlier-run, and it wrote no round."""
    import os
    import signal

    killed = subprocess.Popen(SIMULATE + ["--out", "o", "--drop-probability", "1", "--deadline", "300", "--log-level",
                                          "info"], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        for line in killed.stderr:
            if "round 1: sampled" in line:
                break
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
        _wait_until_free(cwd / "o")
    finally:
        killed.kill()
    assert "metrics.jsonl" not in {p.name for p in (cwd / "o").iterdir()}


def test_the_outputs_a_killed_run_had_set_aside_are_put_back_by_the_next_run(tmp_path, capfd):
    """QA: a run into an earlier run's --out, killed (kill -9, the OOM killer) before its first round, left that
    run's files only in OUT/.earlier-run; the next run deleted them, even one refused on its data."""
    made = run_main(SIMULATE_HERE + ["--out", "o"], capfd, tmp_path)
    assert made.returncode == 0, made.stderr
    before = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()}
    _fresh_run_killed_before_its_first_round(tmp_path)
    line = _refused(["--out", "o", "--partition", "shards:500"], tmp_path, capfd)
    assert "500 shards" in line, line
    assert {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir() if p.name in before} == before
    assert not (tmp_path / "o" / ".earlier-run").exists()


def test_a_resumed_run_gets_back_its_outputs_that_a_killed_fresh_run_had_set_aside(tmp_path, capfd):
    """QA: a run with a checkpoint folder, then a fresh run into its --out killed (kill -9) before its first round:
    the first run's files were left in OUT/.earlier-run, and resuming the first run started a metrics.jsonl of its
    later rounds only. Its resume now puts them back first, and its rows go on."""
    import json

    first = SIMULATE + ["--out", "o", "--checkpoint-dir", "ckpt"]
    made = run_main(first[3:], capfd, tmp_path)
    assert made.returncode == 0, made.stderr
    _fresh_run_killed_before_its_first_round(tmp_path)
    resumed = run_main([*first[3:first.index("--rounds") + 1], "3", *first[first.index("--rounds") + 2:]], capfd,
                       tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    rows = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [1, 2, 3], rows
    assert not (tmp_path / "o" / ".earlier-run").exists()
