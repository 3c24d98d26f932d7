"""What a QA pass of `fedpar serve --state` and `fedpar run` found: a run file's mistakes the service finds name the
file's keys (not serve's flags), `fedpar run logs ID -f` exits as the run it followed ended, and a state path in a
folder that is not there is refused rather than made. Real gRPC over mutual TLS on 127.0.0.1 (port 0), and a real
`fedpar serve --state` process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fedpar.cli.main import main
from fedpar.security.tls import server_credentials, server_tls_files
from fedpar.server.run_control import RunControlServer
from fedpar.server.run_store import MissingFolder, RunStore, StoreError, check_state_folder
from support.in_process import main_here
from support.processes import port_in_file, stop_processes

ROOT = Path(__file__).resolve().parents[2]


def _main_here(*argv: str) -> tuple[int, str, str]:
    """`fedpar ARGV` by its main in this process: exit code, stdout, stderr."""
    done = main_here(*argv)
    return done.returncode, done.stdout, done.stderr


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A `fedpar serve --state` process with no agent (a run it accepts waits), and `fedpar run` to reach it."""
    tmp = tmp_path_factory.mktemp("service")
    certs = tmp / "certs"
    assert main(["certs", "--out", str(certs), "--operators", "op"]) == 0
    log = open(tmp / "serve.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", "serve", "--state", str(tmp / "state.db"),
                                "--certs", str(certs), "--port", "0", "--control-port", "0",
                                "--control-port-file", str(tmp / "cport")], cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        control = f"127.0.0.1:{port_in_file(tmp / 'cport', process, tmp / 'serve.log')}"

        def submit(text: str) -> tuple[int, str, str]:
            path = tmp / "run.toml"
            path.write_text(text)
            return _main_here("run", "submit", str(path), "--control", control, "--certs", str(certs),
                              "--operator", "op")
        submit.path = tmp / "run.toml"
        yield submit
    finally:
        stop_processes(process)
        log.close()


# (run file, what the line says after 'fedpar run: run.toml: '): each cross-option check the service makes
RUN_FILE_MISTAKES = [
    ('privacy = "central"\n', 'privacy = "central" needs privacy_population: the number of agents that may be '
                              'sampled'),
    ('topk_ratio = 0.1\n', 'topk_ratio applies only with compression = "topk"; add it'),
    ('compression = "topk"\nint8_block = 64\n', 'int8_block applies only with compression = "int8"; add it'),
    ('privacy_noise = 2.0\n', 'privacy_noise applies only with privacy = "central" or privacy = "client"'),
    ('privacy = "central"\nprivacy_population = 5\nprivacy_local_noise = 0.5\n',
     'privacy_local_noise applies only with privacy = "client", not central: the agents add it to their own '
     'update; use privacy = "client"'),
    ('secure_aggregation = true\ncompression = "topk"\n',
     'secure_aggregation = true cannot run with compression = "topk"'),
    ('min_reports = 10\nclients_per_round = 2\n', 'min_reports (10) cannot exceed clients_per_round (2)'),
]


@pytest.mark.parametrize("text,said", RUN_FILE_MISTAKES, ids=[t.split(" ")[0] for t, _ in RUN_FILE_MISTAKES])
def test_a_run_file_mistake_the_service_finds_names_the_files_keys(service, text, said):
    # it named serve's flags: 'fedpar run: --privacy needs --privacy-population', '--topk-ratio applies only with
    # --compression topk', though the file has no flags
    code, out, err = service(text)
    line = _one_line(err)
    assert code == 2 and out == "", (code, out, err)
    assert line.startswith(f"fedpar run: {service.path}: {said}"), line
    assert " --" not in line.removeprefix(f"fedpar run: {service.path}:"), line  # no flag is left


def test_the_same_checks_on_the_command_line_still_name_flags(tmp_path):
    out = str(tmp_path / "out")
    code, _, err = _main_here("serve", "--insecure", "--port", "0", "--rounds", "1", "--out", out, "--privacy",
                              "central")
    assert code == 2 and _one_line(err) == ("fedpar serve: --privacy central needs --privacy-population: the number "
                                            "of agents that may be sampled")
    code, _, err = _main_here("serve", "--insecure", "--port", "0", "--rounds", "1", "--out", out, "--topk-ratio",
                              "0.1")
    assert code == 2 and _one_line(err).startswith("fedpar serve: --topk-ratio applies only with --compression topk")
    code, _, err = _main_here("serve", "--insecure", "--port", "0", "--rounds", "1", "--out", out,
                              "--secure-aggregation", "--compression", "topk")
    assert code == 2 and _one_line(err).startswith("fedpar serve: --secure-aggregation cannot run with --compression "
                                                   "topk")


def test_a_service_flag_in_a_refusal_stays_a_flag():
    from fedpar.cli.run_settings import said_with_keys

    said = said_with_keys("--privacy needs a fixed cohort: use --clients-per-round instead of --fraction; see "
                          "examples/--privacy and --privacy-clip-lr, --lr, --deadline, --max-agent-share")
    assert said == ("privacy needs a fixed cohort: use clients_per_round instead of --fraction; see examples/--privacy "
                    "and privacy_clip_lr, learning_rate, deadline_seconds, --max-agent-share")


@pytest.fixture
def control(tmp_path):
    """A control API over a run store (nothing executes its runs: the test ends them), and `fedpar run` options."""
    certs = tmp_path / "certs"
    assert main(["certs", "--out", str(certs), "--operators", "op"]) == 0
    store = RunStore(tmp_path / "state.db")
    server = RunControlServer(store, lambda settings: (settings, ""), "127.0.0.1", 0,
                              server_credentials(server_tls_files(certs)))
    yield store, ("--control", f"127.0.0.1:{server.port}", "--certs", str(certs), "--operator", "op")
    server.stop(0)
    store.close()


def test_run_logs_f_exits_1_for_a_run_that_failed_or_was_stopped_and_0_for_one_that_finished(control):
    # 'fedpar run logs ID -f' of a failed run exited 0: a script waiting on the run could not tell
    store, options = control
    ends = {}
    for status in ("finished", "failed", "stopped"):
        run_id = store.submit(status, {"rounds": 1}, who="op")
        store.start(run_id, "")
        store.log(run_id, f"run {run_id} started")
        ends[status] = run_id
    ended = threading.Timer(0.5, lambda: [store.end(run_id, status, f"it {status}") for status, run_id in
                                          ends.items()])
    ended.start()  # while the follows are under way
    try:
        for status, code in (("failed", 1), ("finished", 0), ("stopped", 1)):
            got, out, err = _main_here("run", "logs", str(ends[status]), "-f", *options)
            assert (got, err) == (code, ""), (status, got, err)
            assert out.splitlines() == [f"run {ends[status]} started", f"run {ends[status]} is {status}"], out
    finally:
        ended.join()
    got, out, err = _main_here("run", "logs", str(ends["failed"]), *options)  # no -f: what the log holds so far
    assert got == 0 and out.splitlines()[-1] == f"run {ends['failed']} is failed", (got, out, err)


def test_a_state_file_in_a_folder_that_is_not_there_is_refused_and_nothing_is_made(tmp_path):
    missing = tmp_path / "nonexistent" / "deeper" / "x.db"
    with pytest.raises(StoreError) as refused:
        RunStore(missing)
    assert str(refused.value) == (f"the folder {missing.parent} of state file {missing} does not exist; create it "
                                  "first, or give --state another path")
    assert isinstance(refused.value, FileNotFoundError) and refused.value.exit_code == 2
    (tmp_path / "file").write_text("")
    with pytest.raises(MissingFolder, match="is a file, not a folder"):
        check_state_folder(tmp_path / "file" / "x.db")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    check_state_folder(tmp_path / "x.db")  # its folder is there: nothing to say


def test_serve_state_in_a_folder_that_is_not_there_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "nonexistent" / "x.db"
    code, _, err = _main_here("serve", "--state", str(missing), "--insecure", "--port", "0", "--control-port", "0")
    assert not missing.parent.exists()
    assert code == 2 and _one_line(err).startswith(f"fedpar serve: the folder {missing.parent} of state file "
                                                   f"{missing} does not exist; create it first"), (code, err)
