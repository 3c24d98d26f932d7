"""`fedpar run`'s mistakes as QA found them: options an action does not use, run names with control characters or
of any length, run ids out of the protocol's range, a get whose outputs folder is gone or whose model is damaged, a
stop of a run that ended, run files called config files and refused the keys --config files take, and the 'refused
get' audit rows without their run. A real control API (real gRPC over mutual TLS on 127.0.0.1, port 0) over a real
run store, and `fedpar run` by its main."""

from __future__ import annotations

import contextlib
import io
import os
import pty
import threading
import time
from pathlib import Path

import grpc
import numpy
import pytest
import safetensors.numpy

from fedpar.cli.main import main
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol import fedpar_pb2_grpc as pb_grpc
from fedpar.security.certs import CertPaths
from fedpar.security.tls import TlsFiles, channel_credentials
from fedpar.server.run_store import RunStore
from support.control_api import control_api
from support.in_process import environment_put_back, main_here, torch_state_put_back


@pytest.fixture
def control(tmp_path):
    """A control API over an empty run store (nothing executes its runs), the options that reach it, and the
    store."""
    with control_api(tmp_path) as made:
        yield made


def _run(options, *argv: str):
    return main_here("run", *argv, *options)


def _one_line(done, code: int) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code and len(lines) == 1 and "Traceback" not in done.stderr, done
    return lines[0]


def _ended_run(store: RunStore, folder: Path, files: dict[str, bytes], status: str = "finished") -> int:
    """A run that started in ``folder``, left ``files`` there and ended ``status``."""
    run_id = store.submit("done", {"rounds": 1}, who="op")
    folder.mkdir()
    store.start(run_id, str(folder))
    for name, data in files.items():
        (folder / name).write_bytes(data)
    store.end(run_id, status, "", str(folder / "global.safetensors"))
    return run_id


MODEL = safetensors.numpy.save({"w": numpy.arange(64, dtype=numpy.float32)})


@pytest.mark.parametrize("argv, action, flag, users", [
    (("ls", "--name", "foo"), "ls", "--name", "submit does"),
    (("ls", "-f"), "ls", "--follow", "submit and logs do"),
    (("logs", "1", "--out", "zz"), "logs", "--out", "get does"),
    (("stop", "1", "--name", "x"), "stop", "--name", "submit does"),
    (("get", "1", "--out", "zz", "--follow"), "get", "--follow", "submit and logs do"),
    (("submit", "one.toml", "--out", "zz"), "submit", "--out", "get does"),
])
def test_an_option_the_action_does_not_use_is_refused(control, tmp_path, monkeypatch, argv, action, flag, users):
    store, options, _, _ = control
    monkeypatch.chdir(tmp_path)
    (tmp_path / "one.toml").write_text("rounds = 1\n")
    store.submit("one", {"rounds": 1}, who="op")
    line = _one_line(_run(options, *argv), 2)
    assert line == f"fedpar run: 'fedpar run {action}' does not use {flag} (only {users}): leave it out", line
    assert not (tmp_path / "zz").exists()
    assert [r.status for r in store.runs()] == ["queued"] and len(store.runs()) == 1  # nothing submitted or stopped


def test_a_config_files_follow_and_name_leave_the_actions_that_do_not_use_them_alone(control, tmp_path):
    """QA: with [run] follow = true in a shared operator config, 'fedpar run ls', stop and get were refused ('does not
    use --follow'), naming a flag nobody typed; the file's value is for the actions that use it (one note line, as
    every command says a --config file's key it ignores: cli/config.py ignored_given), a typed flag is still
    refused."""
    store, options, _, _ = control
    run_id = store.submit("one", {"rounds": 1}, who="op")
    config = tmp_path / "ops.toml"
    config.write_text('[run]\nfollow = true\nname = "nightly"\n')
    listed = _run(options, "ls", "--config", str(config))
    assert listed.returncode == 0 and "one" in listed.stdout, listed
    assert listed.stderr.splitlines() == [f"fedpar run: note: ignored from {config}: follow (only submit and logs use "
                                          "it), name (only submit uses it)"], listed
    assert _run(options, "stop", str(run_id), "--config", str(config)).returncode == 0
    assert store.get(run_id).status == "stopped"
    line = _one_line(_run(options, "ls", "--follow", "--config", str(config)), 2)
    assert line == "fedpar run: 'fedpar run ls' does not use --follow (only submit and logs do): leave it out", line


def test_submit_follow_submits_then_follows_the_run_to_its_end(control, tmp_path):
    store, options, _, _ = control
    (tmp_path / "one.toml").write_text("rounds = 1\n")

    def run_it():  # what the service does with the run it was given
        deadline = time.monotonic() + 30
        while not store.runs() and time.monotonic() < deadline:
            time.sleep(0.05)
        run_id = store.runs()[0].id
        store.start(run_id, str(tmp_path / "out"))
        store.log(run_id, "round 1 done")
        time.sleep(0.5)
        store.end(run_id, "failed", "no agents")
    runner = threading.Thread(target=run_it)
    runner.start()
    done = _run(options, "submit", str(tmp_path / "one.toml"), "-f")
    runner.join()
    lines = done.stdout.splitlines()
    run_id = store.runs()[0].id
    assert lines[0] == str(run_id) and "round 1 done" in lines and lines[-1] == f"run {run_id} is failed", done
    assert done.returncode == 1  # as 'run logs -f' of a run that failed


@pytest.mark.parametrize("name, said", [("evil\nname\x1b[31mRED", "control or other unprintable characters"),
                                        ("n" * 5000, "at most 100 characters (this one has 5000)")])
def test_a_name_with_control_characters_or_too_long_is_refused_by_client_and_service(control, tmp_path, name, said):
    store, options, certs, port = control
    (tmp_path / "one.toml").write_text("rounds = 1\n")
    line = _one_line(_run(options, "submit", str(tmp_path / "one.toml"), "--name", name), 2)
    assert said in line and "\x1b" not in line and "--name" in line, line
    assert store.runs() == []
    # another client than 'fedpar run' is refused by the service, audited
    paths = CertPaths(certs)
    with grpc.secure_channel(f"127.0.0.1:{port}", channel_credentials(
            TlsFiles(paths.operator_cert("op"), paths.operator_key("op"), paths.ca_cert))) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.RunControlStub(channel).Submit(pb.RunSubmit(name=name, settings_json="{}"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and said in refused.value.details()
    assert store.runs() == [] and store.audit_rows()[-1]["action"] == "refused submit"


def test_a_name_stored_by_an_older_service_is_printed_escaped(control):
    store, options, _, _ = control
    run_id = store.submit("evil\nname\x1b[31mRED", {"rounds": 1}, who="op")
    store.log(run_id, "run evil\nname\x1b[31mRED waits")
    listing = _run(options, "ls")
    assert listing.returncode == 0 and "\x1b" not in listing.stdout and len(listing.stdout.splitlines()) == 2
    assert "evil\\nname\\x1b[" in listing.stdout, listing.stdout
    logs = _run(options, "logs", str(run_id))
    assert logs.returncode == 0 and "\x1b" not in logs.stdout
    assert "run evil\\nname\\x1b[31mRED waits" in logs.stdout.splitlines(), logs.stdout


@pytest.mark.parametrize("argv", [("get", "99999999999999999999", "--out", "q"), ("stop", "18446744073709551615"),
                                  ("stop", "9223372036854775808"), ("logs", "0"), ("logs", "²"), ("stop", "-1")])
def test_a_run_id_out_of_range_is_one_line(control, tmp_path, monkeypatch, argv):
    _, options, _, _ = control
    monkeypatch.chdir(tmp_path)
    line = _one_line(_run(options, *argv), 2)
    assert f"'fedpar run {argv[0]}' takes one run id (a whole number from 1 to 9223372036854775807" in line, line
    assert not (tmp_path / "q").exists()


def test_get_of_a_run_whose_outputs_folder_is_gone_says_so_and_audits_the_run(control, tmp_path):
    store, options, _, _ = control
    run_id = _ended_run(store, tmp_path / "run-1", {"global.safetensors": MODEL})
    for path in (tmp_path / "run-1").iterdir():
        path.unlink()
    (tmp_path / "run-1").rmdir()
    line = _one_line(_run(options, "get", str(run_id), "--out", str(tmp_path / "got")), 2)
    assert f"its outputs folder {tmp_path / 'run-1'} is gone from the service's machine" in line, line
    assert not (tmp_path / "got").exists()
    refused = [r for r in store.audit_rows() if r["action"] == "refused get"]
    assert [r["run_id"] for r in refused] == [run_id]  # the run asked for (the column was empty)


def test_get_of_a_damaged_model_writes_nothing(control, tmp_path):
    store, options, _, _ = control
    run_id = _ended_run(store, tmp_path / "run-1", {"global.safetensors": MODEL[:-7], "summary.json": b"{}"})
    there = tmp_path / "there"
    there.mkdir()
    for out in (tmp_path / "got", there):
        line = _one_line(_run(options, "get", str(run_id), "--out", str(out)), 2)
        assert f"the model of run {run_id} on the service is damaged (global.safetensors: " in line, line
        assert (out.is_dir() and not any(out.iterdir())) if out == there else not out.exists()
    (tmp_path / "run-1" / "global.safetensors").write_bytes(MODEL)  # whole: written
    done = _run(options, "get", str(run_id), "--out", str(tmp_path / "got"))
    assert done.returncode == 0 and (tmp_path / "got" / "global.safetensors").read_bytes() == MODEL, done


def test_get_into_an_out_with_a_folder_where_a_file_goes_is_one_line_and_writes_nothing(control, tmp_path):
    """QA: it downloaded, replaced the files before that name, then failed on the folder: exit 1 with a line naming
    summary.json.part, the other files' .part left behind."""
    store, options, _, _ = control
    run_id = _ended_run(store, tmp_path / "run-1", {"global.safetensors": MODEL, "summary.json": b"{}"})
    out = tmp_path / "got"
    (out / "summary.json").mkdir(parents=True)
    line = _one_line(_run(options, "get", str(run_id), "--out", str(out)), 2)
    assert line == (f"fedpar run: --out {out}: {out / 'summary.json'}, a file the run writes, is a folder; move it "
                    "away, or give another --out"), line
    assert [p.name for p in out.iterdir()] == ["summary.json"]


@pytest.mark.parametrize("status", ["finished", "failed", "stopped"])
def test_stop_of_a_run_that_ended_is_one_line_and_exit_1(control, tmp_path, status):
    store, options, _, _ = control
    run_id = _ended_run(store, tmp_path / "run-1", {"global.safetensors": MODEL}, status)
    done = _run(options, "stop", str(run_id))
    assert _one_line(done, 1) == f"fedpar run: run {run_id} already ended ({status}): nothing to stop"
    assert done.stdout == "" and store.get(run_id).status == status


def test_run_file_mistakes_name_a_run_file(control, tmp_path):
    _, options, _, _ = control
    (tmp_path / "bad.toml").write_text("rounds = \n")
    assert _one_line(_run(options, "submit", str(tmp_path / "nofile.toml")), 2) == \
        f"fedpar run: run file {tmp_path / 'nofile.toml'} does not exist"
    assert _one_line(_run(options, "submit", str(tmp_path / "bad.toml")), 2).startswith(
        f"fedpar run: run file {tmp_path / 'bad.toml'} is not valid TOML")


def test_a_run_file_takes_the_keys_a_config_file_takes(control, tmp_path):
    store, options, _, _ = control
    (tmp_path / "one.toml").write_text("rounds = 1\nlr = 0.05\ndeadline = 30\n")
    done = _run(options, "submit", str(tmp_path / "one.toml"))
    assert done.returncode == 0, done
    settings = store.runs()[0].settings
    assert settings["learning_rate"] == 0.05 and settings["deadline_seconds"] == 30.0, settings
    (tmp_path / "two.toml").write_text("lr = 0.05\nlearning_rate = 0.1\n")
    assert "lr and learning_rate are the same option; keep learning_rate" in _one_line(
        _run(options, "submit", str(tmp_path / "two.toml")), 2)


def test_run_help_describes_the_operator_certificate():
    done = main_here("run", "--help")
    said = " ".join(done.stdout.split())
    assert done.returncode == 0 and "DIR/operators/NAME.pem and NAME.key of --operator NAME (run)" in said, said
    assert "with logs or submit (also -f)" in said


@pytest.mark.parametrize("argv, said", [
    (("lss",), "unknown action 'lss' (did you mean ls?): use one of submit, ls, logs, stop, get"),
    (("list",), "unknown action 'list' (did you mean ls?): use one of submit, ls, logs, stop, get"),
    (("cancel", "3"), "unknown action 'cancel' (did you mean stop?)"),
    (("LOG", "3"), "unknown action 'LOG' (did you mean logs?)"),
    (("xyz",), "unknown action 'xyz': use one of submit, ls, logs, stop, get"),
    (("submit",), "'fedpar run submit' takes one run file (TOML)"),
    (("logs",), "'fedpar run logs' takes one run id"),
    (("stop", "abc"), "'fedpar run stop' takes one run id"),
    (("get", "1"), "'fedpar run get' needs --out DIR"),
    (("ls", "--name", "x"), "'fedpar run ls' does not use --name"),
])
def test_a_mistake_in_the_command_line_is_said_before_the_certificates_are_asked_for(tmp_path, argv, said):
    """'fedpar run lss' (or a submit without its file) said 'the control API needs mutual TLS: give --certs DIR and
    --operator NAME': the newcomer added them and only then learned what was wrong (QA, the service guide)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fedpar", "run", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    line = _one_line(done, 2)
    assert line.startswith(f"fedpar run: {said}"), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("action", ["logs", "submit"])
def test_ctrl_c_of_a_follow_says_the_run_goes_on_and_how_to_stop_it(control, tmp_path, action):
    """Ctrl-C of 'fedpar run submit -f' (or 'logs -f') said only 'fedpar run: interrupted', as one-shot serve's
    Ctrl-C, which ends its run, says it: the run went on at the service (QA, the service guide)."""
    import os
    import signal
    import subprocess
    import sys

    store, options, _, _ = control
    (tmp_path / "one.toml").write_text("rounds = 1\n")
    argv = ["logs", str(store.submit("one", {"rounds": 1}, who="op"))] if action == "logs" else ["submit", "one.toml"]
    follow = subprocess.Popen([sys.executable, "-m", "fedpar", "run", *argv, "-f", *options], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        run_id = int(follow.stdout.readline()) if action == "submit" else 1  # submit prints the id, then follows
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(a["action"] == "logs" for a in store.audit_rows()):
            time.sleep(0.05)  # the service audits the Logs call as it comes: the follow is open then
        time.sleep(0.5)
        os.killpg(follow.pid, signal.SIGINT)
        _, err = follow.communicate(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"fedpar run: stopped following run {run_id}, which goes on at the "
                                            f"service ('fedpar run stop {run_id}' stops it; 'fedpar run logs {run_id} "
                                            "-f' follows it again)"), err
    assert store.get(run_id).status == "queued"  # the run was not stopped


def test_a_submit_at_a_terminal_says_how_to_follow_the_run_and_a_script_gets_the_id_alone(control, tmp_path):
    store, options, _, _ = control
    (tmp_path / "one.toml").write_text("rounds = 1\n")
    piped = _run(options, "submit", str(tmp_path / "one.toml"))
    assert (piped.returncode, piped.stdout, piped.stderr) == (0, "1\n", ""), piped  # id=$(fedpar run submit ...)
    master, follower = pty.openpty()
    err = io.StringIO()
    with open(follower, "w") as terminal, contextlib.redirect_stdout(terminal), contextlib.redirect_stderr(err), \
            environment_put_back(), torch_state_put_back():
        code = main(["run", "submit", str(tmp_path / "one.toml"), *options])
    said = os.read(master, 4096).decode()
    os.close(master)
    assert (code, said) == (0, "2\r\n")
    assert err.getvalue() == ("run 2 is submitted: follow it with 'fedpar run logs 2 -f' and fetch its model with "
                              "'fedpar run get 2 --out DIR' (with the same --control, --certs and --operator)\n")
    assert [r.id for r in store.runs()] == [1, 2]
