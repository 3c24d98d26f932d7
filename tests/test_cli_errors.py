"""Mistakes and interrupts as a user meets them: each a `fedpar` subprocess that must end with one clear line,
a non-zero exit code and no traceback (issue 17)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.in_process import run_main

FEDPAR = [sys.executable, "-m", "fedpar"]


def astuple_of(done: subprocess.CompletedProcess) -> tuple[int, str, str]:
    """A command's exit code, stdout and stderr, as :func:`_finish` gives a process's."""
    return done.returncode, done.stdout, done.stderr


def _start(args: list[str], cwd: Path, tmpdir: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
    return subprocess.Popen([*FEDPAR, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _one_line(err: str, expected: str) -> str:
    """The stderr line holding ``expected``; no traceback anywhere."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if expected in line]
    assert len(lines) == 1, err
    return lines[0]


def test_bad_options_and_paths_are_refused_in_one_line(tmp_path, capfd):
    (tmp_path / "a-file").write_text("")
    certs = tmp_path / "certs"
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    busy = holder.getsockname()[1]
    assert run_main(["certs", "--out", str(certs), "--agents", "alice,bob"], capfd).returncode == 0
    cases = [  # (args, exit code, the line's text)
        (["serve", "--port", "99999"], 2, "argument --port: 99999 is out of range: a TCP port (0 picks a free one) "
                                          "must be in 0..65535"),
        (["simulate", "--drop-probability", "1.5"], 2, "argument --drop-probability: 1.5 is out of range"),
        (["simulate", "--clients", "0"], 2, "argument --clients: 0 is out of range: a count must be at least 1"),
        (["train", "--lr", "-1"], 2, "argument --lr: -1 is out of range: it must be greater than 0"),
        # these two reached the run: 'the task's client_data raised ... fix the task (None)', numpy's words
        (["simulate", "--val-fraction", "1"], 2, "argument --val-fraction: 1 is out of range: it must be in [0, 1)"),
        (["simulate", "--seed", "-5"], 2, "argument --seed: -5 is out of range: a seed must be in 0..4294967295"),
        (["simulate", "--client-per-round", "5"], 2, "fedpar simulate: error: unrecognized arguments: "
         "--client-per-round 5 (did you mean --clients-per-round?); see 'fedpar simulate --help'"),
        (["serve", "--insecur"], 2, "fedpar serve: error: unrecognized arguments: --insecur (did you mean "
                                    "--insecure?); see 'fedpar serve --help'"),
        # another tool's name for a setting is told this command's, with the value where it is one of ours
        (["simulate", "--epochs", "2"], 2, "--epochs 2 (did you mean --local-epochs?)"),
        (["train", "--learning-rate", "0.1"], 2, "--learning-rate 0.1 (did you mean --lr?)"),
        (["simulate", "--num-supernodes", "50"], 2, "--num-supernodes 50 (did you mean --clients?)"),
        (["serve", "--fraction-fit", "0.1"], 2, "--fraction-fit 0.1 (did you mean --fraction?)"),
        (["simulate", "--iid"], 2, "--iid (did you mean --partition iid?)"),
        (["simulate", "--gpu"], 2, "--gpu (did you mean --device cuda?)"),
        (["simulate", "--mu", "0.1"], 2, "--mu 0.1 (did you mean --strategy-option proximal_mu=MU?)"),
        (["train", "--rounds", "1"], 2, "fedpar train: error: unrecognized arguments: --rounds 1; see "
                                        "'fedpar train --help'"),
        # a misspelled choice is told the one it likely meant, a command's too; a word argparse would list is not
        (["simulte"], 2, "fedpar: error: argument COMMAND: invalid choice: 'simulte' (did you mean simulate?) "
                         "(choose from 'serve', 'client', 'simulate', "),
        (["help"], 2, "invalid choice: 'help' (did you mean --help?) (choose from"),
        (["simulate", "--clock", "virtal"], 2, "fedpar simulate: error: argument --clock: invalid choice: 'virtal' "
                                               "(did you mean virtual?) (choose from 'real', 'virtual'); see "),
        (["simulate", "--privacy", "clinet"], 2, "invalid choice: 'clinet' (did you mean client?) (choose from "),
        (["simulate", "--clock", "sundial"], 2, "invalid choice: 'sundial' (choose from 'real', 'virtual'); see "),
        (["serve", "--insecure", "--port", "0", "--out", str(tmp_path / "a-file")], 2,
         f"--out {tmp_path / 'a-file'}: {tmp_path / 'a-file'} is a file, not a folder"),
        (["simulate", "--out", str(tmp_path / "a-file" / "run")], 2, "is a file, not a folder"),
        (["serve", "--insecure", "--port", str(busy), "--out", str(tmp_path / "s")], 2,
         f"port {busy} on 127.0.0.1 is in use by another process; stop it or pick another --port"),
        (["serve", "--insecure", "--port", "0", "--dataset", "mnist", "--data-dir", str(tmp_path / "nowhere"),
          "--out", str(tmp_path / "s")], 2, f"MNIST folder {tmp_path / 'nowhere'} does not exist"),
        (["client", "--insecure", "--agent-id", "a", "--server", "127.0.0.1:abc"], 2,
         "argument --server: '127.0.0.1:abc': the port must be a number in 1..65535"),
        (["client", "--insecure", "--agent-id", "a", "--server", "localhost"], 2,
         "argument --server: 'localhost' is not HOST:PORT (e.g. 127.0.0.1:50051)"),
        (["certs", "--out", str(certs), "--revoke", "bbo"], 2,
         "--revoke bbo: no certificate or enrollment token for agent 'bbo'"),
    ]
    try:  # each command's main in this process: every refusal comes before anything starts
        results = [astuple_of(run_main(args, capfd, tmp_path)) for args, _, _ in cases]
    finally:
        holder.close()
    for (args, code, text), (rc, _, err) in zip(cases, results):
        assert rc == code, (args, err)
        _one_line(err, text)
    assert not (certs / "revoked.txt").exists()  # nothing was revoked


def _said_in_process(argv: list[str], capsys) -> tuple[int, list[str]]:
    """The exit code and stderr lines of ``fedpar ARGV`` run in this process (a parse error: argparse's SystemExit);
    the torch threads an agent's command sets for itself are put back after."""
    import torch

    from fedpar.cli.main import main

    threads = torch.get_num_threads()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        torch.set_num_threads(threads)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv, code, line", [
    # a hang: the port file was written once the port was open, on the port's event loop, and its error was lost
    (["serve", "--port-file", "{tmp}"], 2, "fedpar serve: error: argument --port-file: {tmp} is a folder; give the "
                                           "path of a file to write, e.g. {tmp}/port"),
    (["serve", "--port-file", "{tmp}/nowhere/port"], 2, "argument --port-file: {tmp}/nowhere/port: its folder "
                                                         "{tmp}/nowhere does not exist; create the folder"),
    (["serve", "--state", "{tmp}/state.db", "--control-port-file", "{tmp}/a-file/port"], 2,
     "argument --control-port-file: {tmp}/a-file/port: its folder {tmp}/a-file is a file, not a folder"),
    (["serve", "--port-file", ""], 2, "argument --port-file: an empty path: give the path of a file to write"),
    # an empty host reached gRPC (its own 'E... add_port.cc' log line, then 'the port is in use'); a host that is not
    # this machine's said 'the port is in use' too, with --port 0
    (["serve", "--host", ""], 2, "argument --host: '' is not a host name or an IP address (e.g. 127.0.0.1, or "
                                 "0.0.0.0 for every interface)"),
    (["simulate", "--metrics-host", " "], 2, "argument --metrics-host: '' is not a host name or an IP address"),
    # said 'pick another --metrics-port' (simulate) and 'check --host' (serve); without --metrics-port: ignored
    (["simulate", "--metrics-port", "0", "--metrics-host", "192.0.2.1", "--clients", "2", "--out", "{tmp}/s"], 2,
     "fedpar simulate: cannot listen on 192.0.2.1: it is not an address of this machine; check --metrics-host"),
    (["serve", "--insecure", "--port", "0", "--metrics-port", "0", "--metrics-host", "192.0.2.1", "--out", "{tmp}/s"],
     2, "fedpar serve: cannot listen on 192.0.2.1: it is not an address of this machine; check --metrics-host"),
    (["simulate", "--metrics-host", "0.0.0.0", "--clients", "2", "--out", "{tmp}/s"], 2,
     "fedpar simulate: --metrics-host applies only with --metrics-port; add it (or drop the option)"),
    (["serve", "--insecure", "--port", "0", "--metrics-host", "0.0.0.0", "--out", "{tmp}/s"], 2,
     "fedpar serve: --metrics-host applies only with --metrics-port; add it (or drop the option)"),
    (["serve", "--insecure", "--port", "0", "--host", "192.0.2.1", "--out", "{tmp}/s"], 2,
     "fedpar serve: cannot listen on 192.0.2.1: it is not an address of this machine; check --host"),
    # --out '': serve listened, then ended in a TypeError traceback writing its outputs to None
    (["serve", "--out", ""], 2, "argument --out: an empty path: give a folder, e.g. runs/first"),
    (["certs", "--out", "", "--agents", "a"], 2, "argument --out: an empty path"),
    (["simulate", "--checkpoint-dir", ""], 2, "argument --checkpoint-dir: an empty path: give a file's or a "
                                              "folder's path"),
    (["serve", "--enrollment-tokens", ""], 2, "argument --enrollment-tokens: an empty path"),
    # an empty word ran as if the option were not given: without the task, the app, the strategy, the trace asked for
    # (--task "$TASK" with TASK unset); simulate said "--task: '' is not a reference: ... fix the task ()"
    (["train", "--task", ""], 2, "fedpar train: error: argument --task: an empty value: give one, or leave the "
                                 "option out"),
    (["simulate", "--strategy", ""], 2, "argument --strategy: an empty value"),
    (["serve", "--flower-app", ""], 2, "argument --flower-app: an empty value"),
    (["client", "--agent-id", "", "--insecure"], 2, "argument --agent-id: an empty value"),
    # the coordinator's protobuf refused it in every task: each agent worker died with a traceback
    (["simulate", "--batch-size", str(2**32)], 2, "argument --batch-size: 4294967296 is out of range: a count each "
                                                  "task carries (32 bits) must be in 1..4294967295"),
    (["serve", "--local-epochs", str(10**12)], 2, "argument --local-epochs: 1000000000000 is out of range"),
    # declared >= 0 but refused after the data loaded ('--min-reports must be >= 1')
    (["simulate", "--min-reports", "0"], 2, "argument --min-reports: 0 is out of range: a count must be at least 1"),
    # every round failed, 'too few updates arrived (... check --min-reports, --deadline)': the reason was only in
    # metrics.jsonl (secagg_failure)
    (["serve", "--insecure", "--port", "0", "--out", "{tmp}/s", "--secure-aggregation", "--clients-per-round", "4",
      "--secagg-max-weight", "1000000000"], 2,
     "fedpar serve: --secagg-max-weight (1000000000) x the 6 agents sampled per round must fit secure aggregation's "
     "31-bit sum: give --secagg-max-weight 357913941 or less"),
    (["simulate", "--secagg-max-weight", str(2**30)], 2, "argument --secagg-max-weight: 1073741824 is out of range"),
    # trained with a grid step of about 1e30 x agents / 2^31 per coordinate: noise that wiped out the model, exit 0
    (["simulate", "--secure-aggregation", "--secagg-clip", "1e30"], 2,
     "argument --secagg-clip: 1e30 is out of range: a coordinate's clip must be in (0, 10000]"),
    # trained to NaN (momentum 1e30) or never decayed (1)
    (["train", "--momentum", "1"], 2, "argument --momentum: 1 is out of range: it must be in [0, 1)"),
    # each agent's task failed with a MemoryError traceback padding to a block, and the round waited its deadline
    # an OverflowError traceback from datetime.timedelta, making the aggregator ranks' gloo group
    (["simulate", "--aggregator-ranks", "2", "--aggregator-timeout", "1e30"], 2,
     "argument --aggregator-timeout: 1e30 is out of range: seconds must be in (0, 1e+09]"),
    (["train", "--dist-timeout", "1e10"], 2, "argument --dist-timeout: 1e10 is out of range"),
    (["client", "--agent-id", "a", "--give-up-after", "1e30"], 2, "argument --give-up-after: 1e30 is out of range"),
    (["serve", "--insecure", "--port", "0", "--out", "{tmp}/s", "--model", "synthetic", "--params", str(10**12)], 2,
     "fedpar serve: --params 1,000,000,000,000 (a synthetic model) needs about 11175.9 GiB of memory and this "
     "machine has"),  # a MemoryError traceback
    (["client", "--agent-id", "a", "--threads", str(10**12)], 2,  # 'ValueError: Overflow when unpacking long'
     "argument --threads: 1000000000000 is out of range: torch threads must be in 1..1024"),
    # 'OverflowError: date value out of range' (3000000) or 'Python int too large to convert to C int' (10^12)
    (["certs", "--out", "{tmp}/c", "--days", "3000000"], 2,
     "argument --days: 3000000 is out of range: days a certificate is valid (100 years at most) must be in 1..36500"),
    # train: a rank-0 traceback, 'ValueError: Overflow when unpacking long long' (simulate: that line alone)
    (["train", "--seed", str(10**20)], 2,
     "argument --seed: 100000000000000000000 is out of range: a seed must be in 0..4294967295"),
    # each would start that many processes on this machine, until it ran out
    (["serve", "--aggregator-ranks", str(10**12)], 2, "argument --aggregator-ranks: 1000000000000 is out of range: "
                                                      "processes started on this machine must be in 1..1024"),
    (["client", "--agent-id", "a", "--nproc", "100000"], 2, "argument --nproc: 100000 is out of range"),
    (["simulate", "--workers", "5000"], 2, "argument --workers: 5000 is out of range"),
    # sqlite's 'unable to open database file'
    (["serve", "--insecure", "--port", "0", "--state", "{tmp}"], 2,
     "fedpar serve: state file {tmp} is a folder; give --state the path of a file (e.g. {tmp}/state.db)"),
    # cryptography's own words ('Unable to load PEM file. See https://cryptography.io/... MalformedFraming'), and an
    # operator's name called an 'agent id'
    (["certs", "--out", "{tmp}/c", "--revoke-cert", "{tmp}/a-file"], 2,
     "fedpar certs: --revoke-cert {tmp}/a-file is not a PEM certificate; give the .pem file of the certificate to "
     "revoke"),
    (["certs", "--out", "{tmp}/c", "--operators", "a b"], 2, "fedpar certs: operator name 'a b' cannot be used in a "
                                                              "certificate"),
    # the slow clients' tasks failed: 'training raised OverflowError: timestamp out of range for platform time_t'
    (["simulate", "--slow-fraction", "0.5", "--slow-step-delay", "1e30"], 2,
     "argument --slow-step-delay: 1e30 is out of range: seconds a step waits must be in 0..86400"),
    (["simulate", "--compression", "int8", "--int8-block", str(10**12)], 2,
     "argument --int8-block: 1000000000000 is out of range: values per int8 block must be in 1..1048576"),
    # declared >= 0; refused once the data loaded: 'dp noise multiplier must be a finite number > 0, got 0.0'
    (["simulate", "--privacy", "central", "--privacy-noise", "0"], 2,
     "argument --privacy-noise: 0 is out of range: it must be greater than 0"),
    (["simulate", "--privacy", "central", "--privacy-delta", "0"], 2,
     "argument --privacy-delta: 0 is out of range: it must be in (0, 1)"),  # 'dp delta must be in (0, 1), got 0.0'
    (["serve", "--privacy-adaptive-quantile", "1"], 2,
     "argument --privacy-adaptive-quantile: 1 is out of range: it must be in (0, 1)"),
    # a file that is not text, or a folder: "'utf-8' codec can't decode byte 0xcf ..." naming no file, and
    # "[Errno 21] Is a directory: '...'"
    (["client", "--insecure", "--agent-id", "a", "--server", "127.0.0.1:1", "--enrollment-token-file",
      "{tmp}/binary"], 2, "fedpar client: --enrollment-token-file {tmp}/binary is not a text file; give the token "
                          "file 'fedpar certs --mint-token ID' wrote"),
    (["simulate-workers", "--insecure", "--server", "127.0.0.1:1", "--clients", "4", "--trace", "{tmp}"], 2,
     "fedpar simulate-workers: the trace file {tmp} is a folder; give a CSV or JSON file"),
    # a built-in trace's name misspelled was said only as a missing file
    (["simulate", "--clients", "4", "--rounds", "1", "--out", "{tmp}/s", "--trace", "fedscal"], 2,
     "fedpar simulate: the trace file fedscal does not exist (did you mean fedscale?); give a CSV or JSON file"),
    (["simulate", "--clients", "4", "--rounds", "1", "--out", "{tmp}/s", "--trace", "{tmp}/nowhere.csv"], 2,
     "fedpar simulate: the trace file {tmp}/nowhere.csv does not exist; give a CSV or JSON file"),
    (["simulate-workers", "--insecure", "--server", "127.0.0.1:1", "--clients", "4", "--trace", "{tmp}/binary"], 2,
     "fedpar simulate-workers: cannot read the traces in {tmp}/binary: it is not a text file"),
    (["serve", "--insecure", "--port", "0", "--out", "{tmp}/s", "--enrollment-tokens", "{tmp}"], 2,
     "fedpar serve: cannot use {tmp}: Is a directory"),
    (["serve", "--port", "0", "--out", "{tmp}/s", "--certs", "{tmp}/a-file"], 2,  # 'cannot stat .../revoked.txt'
     "fedpar serve: --certs {tmp}/a-file is a file; give the folder 'fedpar certs --out DIR' made"),
    (["client", "--agent-id", "a", "--certs", "{tmp}/a-file"], 2, "fedpar client: --certs {tmp}/a-file is a file"),
])
def test_an_impossible_setting_is_refused_in_one_line_before_anything_runs(argv, code, line, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "binary").write_bytes(b"\xcf\xff\x00")
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    got, lines = _said_in_process(argv, capsys)
    assert (got, len(lines)) == (code, 1), lines
    assert line.replace("{tmp}", str(tmp_path)) in lines[0], lines
    assert "Traceback" not in lines[0]
    assert not (tmp_path / "s").exists() and not (tmp_path / "nowhere").exists()


def test_a_tensorboard_or_run_get_folder_that_is_a_file_is_named_with_what_to_do(tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'fedpar[tensorboard]')")
    (tmp_path / "a-file").write_text("")
    said = f"--tensorboard {tmp_path / 'a-file'}: {tmp_path / 'a-file'} is a file, not a folder; move it aside or " \
        "point --tensorboard at a folder"
    # it was "File exists: a-file in folder ...; remove it or pick another path": neither the option nor a folder
    for command in (["serve", "--insecure", "--port", "0", "--out", str(tmp_path / "s")],
                    ["simulate", "--clients", "2", "--rounds", "1", "--out", str(tmp_path / "s")]):
        code, lines = _said_in_process([*command, "--tensorboard", str(tmp_path / "a-file")], capsys)
        assert code == 2 and not [line for line in lines if "Traceback" in line], lines
        assert lines[-1].startswith(f"fedpar {command[0]}: {said}"), lines
    certs = tmp_path / "certs"
    assert _said_in_process(["certs", "--out", str(certs), "--operators", "op"], capsys)[0] == 0
    code, lines = _said_in_process(["run", "get", "1", "--out", str(tmp_path / "a-file"), "--control", "127.0.0.1:1",
                                    "--certs", str(certs), "--operator", "op"], capsys)
    assert (code, lines) == (2, [f"fedpar run: --out {tmp_path / 'a-file'}: {tmp_path / 'a-file'} is a file, not a "
                                 "folder; move it aside or point --out at a folder"]), lines


def test_an_out_that_is_a_device_is_not_called_a_file_to_remove(capsys):
    # it said "/dev/null is a file, not a folder; remove it or point --out at a folder", to a user who may be root
    code, lines = _said_in_process(["simulate", "--rounds", "1", "--out", "/dev/null"], capsys)
    assert (code, lines) == (2, ["fedpar simulate: --out /dev/null: /dev/null is not a folder (a device, pipe or "
                                 "socket); point --out at a folder"]), lines


@pytest.mark.parametrize("where, said", [("/proc/x", "cannot make the folder"),
                                         ("/proc", "cannot write in the folder")])
def test_a_tensorboard_folder_that_cannot_be_made_is_one_line_and_exit_2_on_every_command(where, said, tmp_path,
                                                                                           capfd):
    """QA: simulate and train exited 1 (the error of the event writer, unnamed), serve 2 without naming the option,
    after it had made its --out."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'fedpar[tensorboard]')")
    commands = [["serve", "--insecure", "--port", "0", "--rounds", "1"],
                ["simulate", "--clients", "2", "--rounds", "1"], ["train", "--epochs", "1"]]
    for command in commands:  # each command's main in this process: the refusal comes before anything starts
        done = run_main([*command, "--out", str(tmp_path / "out"), "--tensorboard", where], capfd, tmp_path)
        lines = [line for line in done.stderr.splitlines() if " fedpar.security " not in line]  # --insecure's
        assert (done.returncode, len(lines)) == (2, 1), done.stderr
        assert lines[0].startswith(f"fedpar {command[0]}: --tensorboard {where}: {said}: "), lines
        assert "; give a folder this user can " in lines[0] and "Traceback" not in done.stderr
        assert not (tmp_path / "out").exists()  # refused before anything started


def test_a_task_factory_that_raises_is_one_line_naming_it_and_its_error_on_every_command(tmp_path, capfd):
    # it was a traceback, where the same file's failing import was one line already
    (tmp_path / "raise_task.py").write_text("def task():\n    raise RuntimeError('boom')\n")
    ref = f"{tmp_path / 'raise_task.py'}:task"
    commands = [["simulate", "--clients", "20", "--rounds", "2", "--out", str(tmp_path / "sim")],
                ["serve", "--insecure", "--port", "0", "--out", str(tmp_path / "served")],
                ["client", "--insecure", "--agent-id", "a", "--server", "127.0.0.1:1"],
                ["train", "--out", str(tmp_path / "trained")]]
    for args in commands:  # each command's main in this process: the refusal comes before anything starts
        rc, out, err = astuple_of(run_main([*args, "--task", ref], capfd, tmp_path))
        assert rc == 2, (args, err)
        assert "Traceback" not in out, out
        line = _one_line(err, "boom")
        assert line == f"fedpar {args[0]}: --task {ref}: the factory raised RuntimeError: boom", line


def test_debug_shows_the_traceback(tmp_path):
    (tmp_path / "a-file").write_text("")
    rc, _, err = _finish(_start(["serve", "--insecure", "--port", "0", "--out", str(tmp_path / "a-file" / "run"),
                                 "--debug"], tmp_path))
    assert rc == 1 and "Traceback" in err and "UserError: --out" in err  # re-raised: Python's exit code


def test_a_missing_mnist_is_one_line_saying_which_files_and_where_to_get_them(tmp_path, capfd):
    empty = tmp_path / "empty"
    empty.mkdir()
    expected = ("expected train.npz and test.npz (arrays x uint8 [N,28,28] and y [N]), or the IDX files "
                "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte "
                "(each may end in .gz): download the four IDX .gz files from "
                "https://ossci-datasets.s3.amazonaws.com/mnist/ (the mirror torchvision uses of "
                "yann.lecun.com/exdb/mnist) into that folder")
    cases = [  # (args, the line)
        (["train", "--dataset", "mnist", "--data-path", str(empty), "--out", str(tmp_path / "t")],
         f"fedpar train: no MNIST files in {empty} (it is empty); {expected}"),
        (["client", "--insecure", "--agent-id", "a", "--dataset", "mnist", "--data-dir", str(empty)],
         f"fedpar client: no MNIST files in {empty} (it is empty); {expected}"),
        (["train", "--dataset", "mnist", "--data-path", str(tmp_path / "nowhere"), "--out", str(tmp_path / "t")],
         f"fedpar train: MNIST folder {tmp_path / 'nowhere'} does not exist; point it at a folder with train.npz"),
        (["train", "--dataset", "mnist", "--out", str(tmp_path / "t")],
         "fedpar train: --dataset mnist needs --data-path DIR holding train.npz and test.npz"),
    ]
    results = [astuple_of(run_main(args, capfd, tmp_path)) for args, _ in cases]  # refused before anything runs
    for (args, line), (rc, _, err) in zip(cases, results):
        assert rc == 2, (args, err)
        assert _one_line(err, line).startswith(line), err
        assert "https://ossci-datasets.s3.amazonaws.com/mnist/" in _one_line(err, line), err


def test_a_simulation_whose_every_round_failed_exits_non_zero_and_a_wrong_data_dir_is_one_line(tmp_path, capfd):
    rc, _, err = astuple_of(run_main(["simulate", "--clients", "2", "--rounds", "1", "--drop-probability", "1",
                                      "--deadline", "1", "--workers", "1", "--out", str(tmp_path / "failed"),
                                      "--quiet"], capfd, tmp_path))
    assert rc == 1
    _one_line(err, "fedpar simulate: every round failed (1 of 1)")
    assert json.loads((tmp_path / "failed" / "summary.json").read_text())["failed_rounds"] == 1
    rc, _, err = astuple_of(run_main(["simulate", "--clients", "2", "--rounds", "1", "--dataset", "mnist",
                                      "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "nodata")],
                                     capfd, tmp_path))
    assert rc == 2
    _one_line(err, f"fedpar simulate: MNIST folder {tmp_path / 'nowhere'} does not exist")
    assert len(err.strip().splitlines()) == 1, err  # the agent workers stay quiet about it


def test_settings_the_coordinator_refuses_are_said_before_the_workers_would_have_started(tmp_path, capfd):
    # the workers start first (their imports overlap the coordinator's set-up); a refusal must not wait on them
    # (it waited 30 s a worker: 61 s for these, each the same line)
    (tmp_path / "a-file").write_text("")
    made = run_main(["simulate", "--clients", "2", "--rounds", "1", "--workers", "1", "--checkpoint-dir",
                     str(tmp_path / "ckpt"), "--quiet"], capfd, tmp_path)
    assert made.returncode == 0, made.stderr
    cases = [  # (args, the line)
        (["--clients", "20", "--clients-per-round", "5", "--min-reports", "10"],
         "--min-reports (10) cannot exceed --clients-per-round (5)"),  # as given: flags, not the fields
        (["--clients", "20", "--clients-per-round", "1", "--secure-aggregation"],
         "secure aggregation hides each update in a sum of several"),
        (["--clients", "1", "--secure-aggregation"],  # it named min_available, a field simulate has no flag for
         "it needs min_available >= 2 (simulate: --clients) and --clients-per-round >= 2"),
        (["--clients", "2", "--checkpoint-dir", str(tmp_path / "a-file")],
         f"the checkpoint directory {tmp_path / 'a-file'} is a file; give a folder"),
        (["--clients", "2", "--strategy", "fedadam", "--checkpoint-dir", str(tmp_path / "ckpt")],
         f"checkpoint in {tmp_path / 'ckpt'} was made with strategy 'fedavg', not 'fedadam'; resume with the "
         "--strategy (and --privacy) it was made with"),
    ]
    for args, line in cases:  # each command's main in this process (its workers are processes all the same)
        started = time.monotonic()
        rc, _, err = astuple_of(run_main(["simulate", "--rounds", "2", "--quiet", *args], capfd, tmp_path))
        assert rc == 2, (args, err)
        _one_line(err, line)
        assert time.monotonic() - started < 25, (args, time.monotonic() - started)


def _wait_for(proc: subprocess.Popen, path: Path, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.05)


def test_ctrl_c_stops_simulate_and_serve_within_two_seconds_with_exit_130_and_a_summary(tmp_path):
    tb = pytest.importorskip("tensorboard", reason="tensorboard is not installed: the simulation also checks "
                             "--tensorboard (pip install 'fedpar[tensorboard]')")
    del tb
    sim_out, serve_out = tmp_path / "sim", tmp_path / "serve"
    scratch = tmp_path / "tmp"  # the simulation's temporary files: its workers' (members' residuals) go with them
    scratch.mkdir()
    sim = _start(["simulate", "--clients", "2", "--rounds", "500", "--local-epochs", "1", "--workers", "1",
                  "--out", str(sim_out), "--tensorboard", str(tmp_path / "tb"), "--quiet"], tmp_path, scratch)
    serve = _start(["serve", "--insecure", "--port", "0", "--port-file", str(tmp_path / "port"), "--out",
                    str(serve_out), "--no-central-eval"], tmp_path)
    _wait_for(serve, tmp_path / "port")
    _wait_for(sim, sim_out / "metrics.csv", timeout=90)  # a round completed
    results = {}
    for name, proc in (("serve", serve), ("simulate", sim)):
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc, out, err = _finish(proc, timeout=30)
        results[name] = (rc, time.monotonic() - started, out, err)
    wrote = {}
    for name, (rc, seconds, out, err) in results.items():
        assert rc == 130, (name, err)
        assert seconds < 2.0, (name, seconds)
        _one_line(err, f"fedpar {name}: interrupted")
        wrote[name] = _wrote(out, {"simulate": sim_out, "serve": serve_out}[name])
    # The "wrote" line names what is on disk, and only that: no plots after Ctrl-C, the model only once a round
    # completed, the model first.
    assert wrote["simulate"][:2] == ["metrics.jsonl", "metrics.csv"]
    assert wrote["simulate"][2:] == ["global.safetensors", "global.json", "summary.json"]
    assert wrote["serve"] == ["summary.json"]
    assert not list(sim_out.glob("*.png")) and not list(serve_out.glob("*.png"))
    from fedpar.cli import serve, simulate
    for command in (serve, simulate):  # --help says so (serve's said 'also after Ctrl-C' of its plots)
        said = " ".join(command.__doc__.split())
        assert "after Ctrl-C" in said and "no plots" in said and "also after Ctrl-C" not in said, said
    assert not list(scratch.iterdir())  # the terminated worker's residual folder was left behind
    summary = json.loads((sim_out / "summary.json").read_text())
    rows = (sim_out / "metrics.jsonl").read_text().splitlines()
    assert summary["interrupted"] and summary["rounds"] == len(rows) >= 1
    kept = json.loads((sim_out / "global.json").read_text())  # the model of the last completed round
    assert kept["interrupted"] and (sim_out / "global.safetensors").is_file()
    # Stopped while closing a round: its model is kept, without the metrics line it had no time to log.
    assert (kept["round"], kept["metrics"]["round"]) == (len(rows), len(rows)) if kept["metrics"] else \
        kept["round"] == len(rows) + 1
    assert not list(serve_out.glob("global.*"))  # no round completed: no model to keep
    assert json.loads((serve_out / "summary.json").read_text()) == {**json.loads((serve_out / "summary.json")
                                                                                 .read_text()), "rounds": 0,
                                                                     "interrupted": True}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert len(events.Scalars("test_accuracy")) >= 1


def test_ctrl_c_stops_a_client_agent_with_exit_130_and_one_line_of_what_it_did(tmp_path):
    """It exited 130 without a word."""
    agent = _start(["client", "--insecure", "--server", "127.0.0.1:1", "--agent-id", "a"], tmp_path)
    seen = []
    while not any("coordinator unreachable" in line for line in seen):  # its run is retrying the coordinator
        seen.append(agent.stderr.readline())
        assert seen[-1], "".join(seen)
    agent.send_signal(signal.SIGINT)
    rc, _, err = _finish(agent, timeout=30)
    assert rc == 130, err
    _one_line(err, "fedpar client: interrupted after 0 tasks, 0 updates accepted, 0 refused")


def _wrote(out: str, folder: Path) -> list[str]:
    """The files the one "wrote FOLDER/a, b and c" line of ``out`` names, each checked to be in ``folder``."""
    lines = [line for line in out.splitlines() if line.startswith("wrote ")]
    assert len(lines) == 1 and lines[0].startswith(f"wrote {folder}/"), out
    names = lines[0].removeprefix(f"wrote {folder}/").replace(" and ", ", ").split(", ")
    missing = [name for name in names if not (folder / name).is_file()]
    assert not missing, (lines[0], missing)
    return names


def test_ctrl_c_stops_train_within_two_seconds_with_exit_130_and_a_summary(tmp_path):
    outs = {nproc: tmp_path / f"train{nproc}" for nproc in (1, 2)}  # in this process, and in 2 spawned ranks
    procs = {nproc: _start(["train", "--model", "mlp", "--dataset", "digits", "--max-steps", "100000", "--nproc",
                            str(nproc), "--device", "cpu", "--log-every", "2", "--no-plot", "--out", str(out)],
                           tmp_path) for nproc, out in outs.items()}
    results = {}
    for nproc, proc in procs.items():
        _wait_for(proc, outs[nproc] / "metrics.jsonl", timeout=90)
        while not (outs[nproc] / "metrics.jsonl").read_text():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc, _, err = _finish(proc, timeout=30)
        results[nproc] = (rc, time.monotonic() - started, err)
    for nproc, (rc, seconds, err) in results.items():
        assert rc == 130, (nproc, err)
        assert seconds < 2.0, (nproc, seconds)
        line = _one_line(err, "fedpar train: interrupted after")
        summary = json.loads((outs[nproc] / "summary.json").read_text())
        logged = [json.loads(r) for r in (outs[nproc] / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in logged if r["kind"] == "train"]
        assert summary["interrupted"] and summary["world_size"] == nproc and summary["steps"] >= steps[-1] >= 2
        # one process keeps the model of its last whole step, and counts its steps; two ranks, the logged ones
        assert (f"after {summary['steps']} steps; " if nproc == 1 else f"after {steps[-1]} logged steps") in line
        assert (outs[nproc] / "metrics.csv").exists()


@pytest.mark.parametrize("command, name", [
    (["train", "--max-steps", "2", "--device", "cpu"], "summary.json"),
    (["train", "--max-steps", "2", "--device", "cpu", "--nproc", "2"], "loss_curve.png"),
    (["simulate", "--clients", "2", "--rounds", "1", "--workers", "1"], "global.safetensors"),
    (["simulate", "--clients", "2", "--rounds", "1", "--workers", "1"], "accuracy.png"),
    (["serve", "--host", "127.0.0.1", "--port", "0", "--insecure", "--rounds", "1"], "summary.json")])
def test_a_folder_where_a_run_writes_a_file_is_refused_before_it_trains(command, name, tmp_path, capfd):
    """It was said only once every round or step had run, exit 1: the run's training was lost."""
    out = tmp_path / "run"
    (out / name).mkdir(parents=True)
    rc, _, err = astuple_of(run_main([*command, "--out", "run"], capfd, tmp_path))  # refused before it starts
    assert (rc, err.splitlines()) == (2, [f"fedpar {command[0]}: --out run: run/{name}, a file the run writes, is a "
                                          "folder; move it away, or give another --out"]), err
    assert sorted(p.name for p in out.iterdir()) == [name]  # nothing trained, logged or set aside


LATE_FOLDER_TASK = """
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import Task
from fedpar.tasks import share_of

X = torch.randn(80, 4)
Y = (X[:, 0] > 0).long()
TRAIN = TensorDataset(X[:60], Y[:60])


def test_data():
    (Path("run") / "accuracy.png").mkdir(exist_ok=True)  # a folder where the plot goes, made once the run started
    return TensorDataset(X[60:], Y[60:])


def task():
    return Task(model=lambda: nn.Linear(4, 2), client_data=lambda p: share_of(TRAIN, p), test_data=test_data,
                loss=nn.functional.cross_entropy, name="late")
"""


def test_an_output_that_cannot_be_written_is_named_in_one_line_and_the_model_is_kept(tmp_path, capfd):
    out = tmp_path / "run"  # a folder in the way at the start is refused then (the test above): this one comes later
    (tmp_path / "late.py").write_text(LATE_FOLDER_TASK)
    rc, stdout, err = astuple_of(run_main(["simulate", "--task", "late.py:task", "--clients", "2", "--rounds", "1",
                                           "--workers", "1", "--local-epochs", "1", "--out", "run", "--quiet"], capfd,
                                          tmp_path))
    assert rc == 1, err
    line = _one_line(err, "fedpar simulate: ")
    assert f"accuracy.png in folder {out}; a folder is in the way: move it or pick another path" in line
    # Written before the plot and after it all the same: the model first, then the summary, then the other plot.
    assert "wrote run/metrics.jsonl, metrics.csv, global.safetensors, global.json, summary.json and loss.png" in line
    assert json.loads((out / "global.json").read_text())["round"] == 1 and (out / "global.safetensors").is_file()
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1
    assert (out / "loss.png").is_file() and (out / "accuracy.png").is_dir()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left behind


def test_a_run_whose_every_update_was_refused_says_why_not_to_check_the_deadline():
    # simulate --lr 1e30: every update held NaN and was refused, and the last line said 'too few updates arrived
    # (see close_reason in metrics.jsonl); check --min-reports, --deadline and the agents' logs'
    from fedpar.cli.user_errors import every_round_failed
    from fedpar.protocol.run_logs import RunningSummary

    running = RunningSummary()
    running.add({"round": 1, "status": "failed", "reported": 0, "rejected": 4, "test_accuracy": 0.1,
                 "refused_because": "tensor 'w' contains NaN or Inf; update refused"})
    assert every_round_failed(running.result()) == ("every round failed (1 of 1): the coordinator refused every "
                                                    "update, e.g. tensor 'w' contains NaN or Inf; update refused; "
                                                    "lower --lr (training diverged)")
    running.add({"round": 2, "status": "failed", "reported": 0, "rejected": 0})  # none came: the old advice
    assert "too few updates arrived" in every_round_failed(running.result())


def test_a_full_disk_is_named_with_the_file_and_its_folder(tmp_path):
    from fedpar.cli.user_errors import describe

    target = tmp_path / "run" / "global.safetensors"
    line = describe(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target)))
    assert line == (f"No space left on device: global.safetensors in folder {tmp_path / 'run'}; free some disk space "
                    "there, or pick a folder on another disk")
    assert describe(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))) == ("No space left on device; free some disk "
                                                                          "space there, or pick a folder on another "
                                                                          "disk")


def test_an_os_error_with_no_path_and_no_known_cause_gets_no_advice_about_paths(tmp_path):
    """`simulate --aggregator-ranks 2` in a forked process once said "No child processes; check the path and the
    permissions": no path was involved."""
    from fedpar.cli.user_errors import describe

    assert describe(ChildProcessError(errno.ECHILD, os.strerror(errno.ECHILD))) == "No child processes"
    assert describe(OSError(errno.EIO, os.strerror(errno.EIO), str(tmp_path / "f"))) == \
        f"Input/output error: f in folder {tmp_path}; check the path and the permissions"


def test_a_write_cut_short_names_the_file_it_was_for(tmp_path):
    """A real write that fails half-way (a file-size limit, as a full disk would, but for this process only): the
    model's safetensors file and an atomic JSON write each raise an OSError naming the file, not its temporary
    name nor none, and leave no part of a file behind; so does a line appended to metrics.jsonl."""
    script = f"""
import resource, signal
from pathlib import Path
import numpy as np
from fedpar.cli.user_errors import describe
from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.run_logs import RoundMetricsLog
from fedpar.protocol.tensorfile import save_tensors
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write beyond the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
out = Path({str(tmp_path / "run")!r})
out.mkdir()
for write in (lambda: save_tensors(out / "global.safetensors", ["w"], [np.zeros(100_000, np.float32)]),
              lambda: atomic_write_bytes(out / "summary.json", [b"x" * 100_000]),
              lambda: RoundMetricsLog(out / "metrics.jsonl").append(dict(round=1, note="x" * 100_000))):
    try:
        write()
    except OSError as exc:
        print(exc.errno, describe(exc))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    folder = tmp_path / "run"
    assert len(lines) == 3, done.stdout
    for line, name in zip(lines, ["global.safetensors", "summary.json", "metrics.jsonl"]):
        assert line == (f"{errno.EFBIG} File too large: {name} in folder {folder}; it is larger than this process "
                        "may write (ulimit -f) or the disk allows; pick another disk"), line
    assert [p.name for p in folder.iterdir()] == ["metrics.jsonl"]  # its torn line is cut off on resume


def test_a_config_file_that_cannot_be_read_as_toml_is_one_line(tmp_path, capsys):
    from fedpar.cli.main import main

    (tmp_path / "latin1.toml").write_bytes(b"\xff\xfe rounds = 3")
    # QA: was "is not valid TOML: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"
    cases = [(tmp_path / "latin1.toml", "latin1.toml is not UTF-8 text: byte 0xff at line 1, column 1 (saved as UTF-16 "
                                        "or Latin-1?); save it as UTF-8"),
             (tmp_path, f"config file {tmp_path} is a folder; give a TOML file"),
             (tmp_path / "nowhere.toml", "does not exist")]
    (tmp_path / "revoke.toml").write_text('[certs]\nrevoke_cert = [""]\n')  # an ArgumentTypeError traceback
    cases.append((tmp_path / "revoke.toml", "revoke.toml: revoke_cert: an empty path: give a file's or a folder's path"))
    (tmp_path / "serve.toml").write_text('[serve]\nrounds = 1\n')  # simulate ran its default rounds, saying nothing
    cases.append((tmp_path / "serve.toml", "has nothing for 'simulate': no [simulate] table and no option at its top "
                                           "level, only [serve]; add a [simulate] table"))
    (tmp_path / "bom.toml").write_bytes(b'\xef\xbb\xbf[simulate]\nrounds = "x"\n')  # QA: 'Invalid statement (at line 1'
    cases.append((tmp_path / "bom.toml", "bom.toml: rounds: expected an integer, got 'x'"))  # read: Notepad's UTF-8
    (tmp_path / "cafe.toml").write_bytes('[simulate]\nout = "café"\n'.encode("latin-1"))
    cases.append((tmp_path / "cafe.toml", "cafe.toml is not UTF-8 text: byte 0xe9 at line 2, column 11"))
    for path, line in cases:
        assert main(["certs" if path.name == "revoke.toml" else "simulate", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and line in err and "Traceback" not in err, err


def test_fedpar_run_with_an_operator_that_has_no_certificate_says_how_to_make_one(tmp_path, capsys):
    from fedpar.cli.main import main

    assert main(["certs", "--out", str(tmp_path / "certs"), "--agents", "a"]) == 0
    capsys.readouterr()
    assert main(["run", "ls", "--certs", str(tmp_path / "certs"), "--operator", "alice"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"holds no certificate of operator 'alice' ({tmp_path}/certs/operators/alice.pem): " \
        f"make one with 'fedpar certs --out {tmp_path}/certs --operators alice'" in err, err


def test_the_services_ports_and_its_control_ports_tls_are_checked_in_one_line_before_anything_binds(tmp_path,
                                                                                                     capfd):
    certs = tmp_path / "certs"
    assert run_main(["certs", "--out", str(certs), "--agents", "a", "--operators", "op"], capfd).returncode == 0
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    busy = holder.getsockname()[1]
    state = ["serve", "--state", str(tmp_path / "state.db")]
    cases = [  # (args, exit code, the line)
        ([*state, "--certs", str(certs), "--port", "0", "--control-port", str(busy)], 2,
         f"port {busy} on 127.0.0.1 is in use by another process; stop it or pick another --control-port"),
        ([*state, "--certs", str(certs), "--port", str(busy)], 2,
         f"port {busy} on 127.0.0.1 is in use by another process; stop it or pick another --port"),
        ([*state, "--certs", str(certs), "--port", "50999", "--control-port", "50999"], 2,
         "--port and --control-port are both 50999: each needs a port of its own"),
        ([*state, "--certs", str(certs), "--port", "0", "--control-port", "50998", "--metrics-port", "50998"], 2,
         "--control-port and --metrics-port are both 50998: each needs a port of its own"),
        ([*state, "--insecure", "--port", "0", "--control-port", "0"], 2,
         "the control port of 'fedpar serve --state' needs mutual TLS even with --insecure"),
        ([*state, "--certs", str(certs), "--port", "0", "--control-port", "0", "--out", "x"], 2,
         "--out is not used with --state"),
        # the one-shot form checks its ports as the service does, before its agents' port is bound
        (["serve", "--certs", str(certs), "--port", "50997", "--metrics-port", "50997", "--rounds", "1", "--out",
          str(tmp_path / "once")], 2, "--port and --metrics-port are both 50997: each needs a port of its own"),
    ]
    try:
        for args, code, line in cases:  # each command's main in this process
            rc, _, err = astuple_of(run_main(args, capfd, tmp_path))
            assert rc == code, (args, err)
            _one_line(err, line)
            assert "add_port.cc" not in err and "Task was destroyed" not in err, err
            # a refused start touches nothing: a state file and its lock were left behind, made before the checks
            assert sorted(p.name for p in tmp_path.iterdir()) == ["certs"], (args, list(tmp_path.iterdir()))
    finally:
        holder.close()


def test_a_refused_service_start_leaves_no_lock_file_and_a_busy_state_file_is_one_plain_line(tmp_path, capfd):
    import fcntl

    certs = tmp_path / "certs"
    assert run_main(["certs", "--out", str(certs), "--agents", "a", "--operators", "op"], capfd).returncode == 0
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"not a database" * 100)
    rc, _, err = astuple_of(run_main(["serve", "--state", str(corrupt), "--certs", str(certs), "--port", "0",
                                      "--control-port", "0"], capfd, tmp_path))
    assert rc == 2, err
    _one_line(err, "is not a fedpar state database or is damaged")
    assert corrupt.read_bytes() == b"not a database" * 100 and not (tmp_path / "corrupt.db.lock").exists()
    # another service holds the state file (its lock): exit 2, one line naming what to do, no traceback hint
    with open(tmp_path / "state.db.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        rc, _, err = _finish(_start(["serve", "--state", str(tmp_path / "state.db"), "--certs", str(certs),
                                     "--port", "0", "--control-port", "0"], tmp_path))
    assert rc == 2, err
    line = _one_line(err, "is in use by another fedpar serve; stop it, or give another --state")
    assert line.startswith("fedpar serve: state file") and "--debug" not in line, err
    assert err.strip() == line, err  # nothing before it either (the certificates' log lines came first)
    assert not (tmp_path / "state.db").exists()
    # QA: a folder where the lock file goes was exit 1, 'Is a directory: state.db.lock in folder ...; a folder is in
    # the way: move it or pick another path (--debug shows the traceback)'
    (tmp_path / "other.db.lock").mkdir()
    rc, _, err = astuple_of(run_main(["serve", "--state", str(tmp_path / "other.db"), "--certs", str(certs), "--port",
                                      "0", "--control-port", "0"], capfd, tmp_path))
    assert (rc, err) == (2, f"fedpar serve: state file {tmp_path / 'other.db'} cannot be locked: "
                            f"{tmp_path / 'other.db.lock'} is not a file this service can use (Is a directory); move "
                            "it aside, or give another --state\n"), err
    assert not (tmp_path / "other.db").exists() and (tmp_path / "other.db.lock").is_dir()


def test_a_folder_where_sqlite_keeps_the_state_files_wal_is_one_line_saying_what_to_do(tmp_path, capfd):
    """QA: 'state file S: unable to open database file', and nothing more."""
    from fedpar.server.run_store import RunStore

    certs = tmp_path / "certs"
    assert run_main(["certs", "--out", str(certs), "--agents", "a", "--operators", "op"], capfd).returncode == 0
    state = tmp_path / "state.db"
    RunStore(state).close()
    kept = state.read_bytes()
    Path(f"{state}-wal").mkdir()
    rc, _, err = astuple_of(run_main(["serve", "--state", str(state), "--certs", str(certs), "--port", "0",
                                      "--control-port", "0"], capfd, tmp_path))
    assert (rc, err) == (2, f"fedpar serve: state file {state}: unable to open database file; SQLite keeps "
                            f"{state}-wal and {state}-shm beside it: each must be a file this user may write, or not "
                            "there (move aside what is in the way), or give another --state\n"), err
    assert state.read_bytes() == kept


def test_a_state_files_write_ahead_log_given_as_the_state_file_is_refused_naming_the_state_file(tmp_path, capfd):
    """QA: --state state.db-wal (a tab completion's slip, after a kill -9 left it) was 'not a fedpar state database or
    is damaged ...; move it aside ... and start again': moving it aside takes the runs submitted since the last
    checkpoint of the WAL with it."""
    from fedpar.server.run_store import RunStore

    certs = tmp_path / "certs"
    assert run_main(["certs", "--out", str(certs), "--agents", "a", "--operators", "op"], capfd).returncode == 0
    state = tmp_path / "state.db"
    RunStore(state).close()
    Path(f"{state}-wal").write_bytes(b"a log of writes")
    for suffix, what in (("-wal", "write-ahead log"), ("-shm", "shared memory index")):
        Path(f"{state}{suffix}").touch()
        rc, _, err = astuple_of(run_main(["serve", "--state", f"{state}{suffix}", "--certs", str(certs), "--port", "0",
                                          "--control-port", "0"], capfd, tmp_path))
        assert (rc, err) == (2, f"fedpar serve: {state}{suffix} is the {what} SQLite keeps beside state file {state}, "
                                f"not a state file: give --state {state} (and leave {state}{suffix} where it is: it "
                                "may hold that file's latest writes)\n"), err
    assert Path(f"{state}-wal").read_bytes() == b"a log of writes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["certs", "state.db", "state.db-shm", "state.db-wal"]


def test_a_state_file_with_two_names_is_refused_under_each(tmp_path, capfd):
    """QA: a second service on the same state file under a hard link's name started (the lock goes by name), with a
    write-ahead log of its own beside it: it did not see the first one's runs, and the two could damage the file."""
    from fedpar.server.run_store import RunStore

    certs = tmp_path / "certs"
    assert run_main(["certs", "--out", str(certs), "--agents", "a", "--operators", "op"], capfd).returncode == 0
    state, other = tmp_path / "state.db", tmp_path / "other.db"
    store = RunStore(state)
    store.submit("kept", {})
    store.close()
    os.link(state, other)
    for name in (other, state):
        rc, _, err = astuple_of(run_main(["serve", "--state", str(name), "--certs", str(certs), "--port", "0",
                                          "--control-port", "0"], capfd, tmp_path))
        assert (rc, err) == (2, f"fedpar serve: state file {name} has 2 names (hard links): a service under each "
                                "would keep a write-ahead log of its own beside it and damage it; remove the other "
                                "names, or give --state a copy\n"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["certs", "other.db", "state.db"]
    other.unlink()  # as the line says: then the file is taken, its runs kept
    store = RunStore(state)
    assert [run.name for run in store.runs()] == ["kept"]
    store.close()


def _serve_until(argv: list[str], cwd: Path, capfd, done) -> subprocess.CompletedProcess:
    """`fedpar ARGV` (a service) by its main in this process, sent SIGTERM once ``done()`` holds (polled)."""
    import threading

    stop = threading.Event()

    def watch():
        while not stop.wait(0.1):
            if done():
                os.kill(os.getpid(), signal.SIGTERM)
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        return run_main(argv, capfd, cwd)
    finally:
        stop.set()
        watcher.join()


def test_a_run_that_could_not_resume_is_tried_again_at_the_services_next_start(tmp_path, capfd):
    """QA: a run whose last checkpoint was damaged failed with 'to resume from the previous checkpoint instead, write
    'round-000001' into .../LATEST', and doing so changed nothing: a failed run stayed failed across restarts (its
    rounds so far lost to the service). It is queued again at the next start."""
    from fedpar.server.run_store import RunStore

    certs = tmp_path / "certs"
    assert run_main(["certs", "--out", str(certs), "--agents", "a", "--operators", "op"], capfd).returncode == 0
    state = tmp_path / "state.db"
    store = RunStore(state)
    run_id = store.submit("r", {})
    store.start(run_id, f"{state}.runs/{run_id}")  # running when the service was killed, its checkpoint damaged
    checkpoint = Path(f"{state}.runs/{run_id}/checkpoints")
    (checkpoint / "round-000001").mkdir(parents=True)
    (checkpoint / "round-000001" / "global.safetensors").write_bytes(b"cut short")
    (checkpoint / "LATEST").write_text("round-000001\n")
    serve = ["serve", "--state", str(state), "--certs", str(certs), "--port", "0", "--control-port", "0"]
    for start in ("was running when the service last ended: it resumes from its last checkpoint",
                  "could not resume when the service last ran: it tries again from its last checkpoint"):
        began = time.time()  # the run fails again at this start (it was failed since the one before: not yet)
        done = _serve_until(serve, tmp_path, capfd, lambda: (run := store.get(run_id)).status == "failed"
                            and run.ended is not None and run.ended >= began)
        assert done.returncode == 0 and f"run {run_id} {start}\n" in done.stdout, done
        run = store.get(run_id)
        assert run.reason.startswith("cannot resume: damaged checkpoint: ") and run.reason.endswith(
            "; the service tries again when it is started again on the same --state"), run.reason
    store.close()


def test_a_service_refuses_run_folders_its_state_file_does_not_know(tmp_path, capfd):
    """A new state file next to an earlier one's STATE.runs (the old file moved aside, as a damaged one's line says)
    numbers its runs from 1 again: run 1 would resume the old run 1's checkpoints and report its results. The start
    is refused in one line, before a new state file is made; a state file that knows its folders starts."""
    from fedpar.server.run_store import RunStore

    certs = tmp_path / "certs"
    assert run_main(["certs", "--out", str(certs), "--agents", "a", "--operators", "op"], capfd).returncode == 0
    state = tmp_path / "state.db"
    (tmp_path / "state.db.runs" / "1" / "checkpoints").mkdir(parents=True)
    (tmp_path / "state.db.runs" / "check").mkdir()  # a submitted run's check: not a run
    serve = ["serve", "--state", str(state), "--certs", str(certs), "--port", "0", "--control-port", "0"]
    rc, _, err = astuple_of(run_main(serve, capfd, tmp_path))
    assert rc == 2, err
    line = _one_line(err, "does not know (an earlier state file's: a new run with that id would resume its "
                          "checkpoints)")
    assert line == (f"fedpar serve: {state}.runs holds the outputs of run 1, which state file {state} does not know "
                    "(an earlier state file's: a new run with that id would resume its checkpoints); move "
                    f"{state}.runs aside with the state file it belongs to, or give --state another path"), line
    assert not state.exists()
    store = RunStore(state)  # a state file that knows run 1 but not run 2's folder
    store.submit("one", {})
    store.close()
    (tmp_path / "state.db.runs" / "2").mkdir()
    rc, _, err = astuple_of(run_main(serve, capfd, tmp_path))
    assert rc == 2 and "holds the outputs of run 2, which state file" in err, err
    # QA: a file where the runs' folder goes: the service started, and each submitted run failed at its start
    file_state = tmp_path / "file.db"
    Path(f"{file_state}.runs").write_text("a user's file\n")
    rc, _, err = astuple_of(run_main([*serve[:2], str(file_state), *serve[3:]], capfd, tmp_path))
    assert (rc, err) == (2, f"fedpar serve: {file_state}.runs is a file, not a folder: the service keeps its runs' "
                            "outputs there; move it aside, or give --state another path\n"), err
    assert not file_state.exists() and not Path(f"{file_state}.lock").exists()
    assert Path(f"{file_state}.runs").read_text() == "a user's file\n"


@pytest.mark.parametrize("args, says", [
    (["simulate", "--clients", "4", "--rounds", "1", "--config", ""],
     "fedpar simulate: error: argument --config: an empty value: give one, or leave the option out; see 'fedpar "
     "simulate --help'"),
    (["run", "ls", "--config"],
     "fedpar run: error: argument --config: expected one argument; see 'fedpar run --help'"),
], ids=["empty", "missing"])
def test_a_config_option_without_a_file_is_one_line(args, says, capfd, tmp_path):
    # QA: --config "" (a variable left unset) ran the simulation on its defaults; a bare --config printed the usage
    # of a parser named 'fedpar' and argparse's own line
    rc, out, err = astuple_of(run_main(args, capfd, tmp_path))
    assert (rc, err) == (2, says + "\n") and list(tmp_path.iterdir()) == [], (rc, out, err)


@pytest.mark.parametrize("args, says", [
    (["simulate", "--clients", "4", "--rounds", "1", "--config", "/dev/zero"],
     "fedpar simulate: config file /dev/zero is not a regular file; give a TOML file"),
    (["serve", "--insecure", "--port", "0", "--revoked", "/dev/zero"],
     "fedpar serve: cannot use /dev/zero: it is not a regular file"),
    (["serve", "--insecure", "--port", "0", "--enrollment-tokens", "/dev/zero"],
     "fedpar serve: cannot use /dev/zero: it is not a regular file"),
    (["client", "--server", "127.0.0.1:1", "--agent-id", "a", "--tls-ca", "/dev/zero"],
     "fedpar client: CA certificate /dev/zero is not a regular file; "),
], ids=["config", "revoked", "tokens", "tls-ca"])
def test_a_settings_file_that_is_not_a_regular_file_is_one_line(args, says, capfd, tmp_path):
    # QA: each of these read /dev/zero whole, until the kernel killed the process at 24 GB (or a MemoryError traceback)
    rc, out, err = astuple_of(run_main(args, capfd, tmp_path))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith(says), err
