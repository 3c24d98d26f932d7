"""`fedpar serve --state`: one long-lived service, two `fedpar client` agents that are never restarted, runs
submitted, listed, followed, stopped and downloaded with `fedpar run` over mutual TLS with an operator certificate;
bad input is one line and a non-zero exit. Real processes on loopback."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.fedpar_pb2_grpc import CoordinatorStub
from fedpar.security.certs import ensure_certs
from fedpar.security.tls import TlsFiles, channel_credentials
from fedpar.server.run_store import RunStore
from support.devices import RANKS_ON_CPU
from support.in_process import main_here
from support.processes import started, stop_processes

ROOT = Path(__file__).resolve().parents[2]
QUICK = 'local_epochs = 1\nbatch_size = 32\nclients_per_round = 2\nmin_reports = 2\n'
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _fedpar(*args: str, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "a") if log else subprocess.PIPE  # a file: a full pipe would block a long-lived process
    return subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", *args], cwd=ROOT, env=ENV, stdout=out,
                            stderr=subprocess.STDOUT if log else subprocess.PIPE, text=True)


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(what)


class Federation:
    """The service, its agents and the `fedpar run` command line to talk to it."""

    def __init__(self, tmp: Path, agent_options: tuple[tuple[str, ...], ...] = ((), ()), min_available: int = 2,
                 *service_options: str):
        self.tmp = tmp
        self.certs = tmp / "certs"
        ensure_certs(self.certs, ["a1", "a2"], ["127.0.0.1"], operators=["op", "op2"])
        self.state = tmp / "state.db"
        self.service = _fedpar("serve", "--state", str(self.state), "--certs", str(self.certs), "--port", "0",
                               "--control-port", "0", "--port-file", str(tmp / "port"), "--control-port-file",
                               str(tmp / "cport"), "--min-available", str(min_available), "--heartbeat", "1",
                               *service_options, log=tmp / "serve.log")
        self.agents: list[subprocess.Popen] = []
        try:
            _wait_for(lambda: (tmp / "cport").exists() or self.service.poll() is not None, 60, "serve did not start")
            assert self.service.poll() is None, (tmp / "serve.log").read_text()
        except BaseException:
            self.close()  # a fixture that fails here gets no teardown
            raise
        self.port = int((tmp / "port").read_text())
        self.control = f"127.0.0.1:{int((tmp / 'cport').read_text())}"
        for options in agent_options:
            self.add_agent(*options)

    def add_agent(self, *options: str) -> None:
        """Start the next agent (a1, then a2) on its half of the data, with ``options`` besides."""
        name, index = f"a{len(self.agents) + 1}", len(self.agents)
        self.agents.append(_fedpar("client", "--server", f"127.0.0.1:{self.port}", "--certs", str(self.certs),
                                   "--agent-id", name, "--num-partitions", "2", "--partition-index", str(index),
                                   "--poll", "1", "--threads", "1", "--max-backoff", "0.5", *options,
                                   log=self.tmp / f"{name}.log"))  # backoff: an agent finds each run's coordinator

    def run(self, *args: str, operator: str = "op") -> subprocess.CompletedProcess:
        """`fedpar run ARGS` against the service, as ``operator`` (a name under certs/operators)."""
        return subprocess.run([sys.executable, "-m", "fedpar.cli.main", "run", *args, "--control", self.control,
                               "--certs", str(self.certs), "--operator", operator], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=120)

    def run_here(self, *args: str, operator: str = "op") -> subprocess.CompletedProcess:
        """`fedpar run ARGS` as :meth:`run` gives it, from this process: the same main, exit code and output, without
        a process's start-up (the control port and the service are as real)."""
        return main_here("run", *args, "--control", self.control, "--certs", str(self.certs), "--operator", operator)

    def submit(self, name: str, text: str, here: bool = False) -> int:
        """`fedpar run submit` of ``text`` as run NAME: its id; ``here``: from this process (:meth:`run_here`)."""
        path = self.tmp / f"{name}.toml"
        path.write_text(text)
        done = (self.run_here if here else self.run)("submit", str(path))
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip())

    def submit_rpc(self, name: str, text: str) -> int:
        """What `fedpar run submit` does, from this process (one fedpar process less to start)."""
        import json

        from fedpar.cli.run_settings import read_run_file
        from fedpar.protocol.fedpar_pb2_grpc import RunControlStub

        path = self.tmp / f"{name}.toml"
        path.write_text(text)
        files = TlsFiles(self.certs / "operators" / "op.pem", self.certs / "operators" / "op.key",
                         self.certs / "ca.pem")
        with grpc.secure_channel(self.control, channel_credentials(files)) as channel:
            return RunControlStub(channel).Submit(pb.RunSubmit(name=name, settings_json=json.dumps(
                read_run_file(path))), timeout=120).run_id

    def serving(self) -> bool:
        """Whether grpc.health.v1 on the agents' port says SERVING."""
        files = TlsFiles(self.certs / "a1.pem", self.certs / "a1.key", self.certs / "ca.pem")
        with grpc.secure_channel(f"127.0.0.1:{self.port}", channel_credentials(files)) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        stop_processes(*self.agents, self.service)


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """One service on two aggregator ranks for the module's first tests (the one-rank form: `one_rank` and the task
    test), on fixed ports: its launcher starts it again on them when its rank 0 is killed (the last test on it)."""
    from support.ports import free_port_run

    tmp = tmp_path_factory.mktemp("service")
    ports = free_port_run(3)  # rank 0, rank 1 (--port + 1), the control port
    fed = Federation(tmp, ((), ()), 2, "--metrics-port", "0", "--tensorboard", str(tmp / "tb"),
                     "--aggregator-ranks", "2", "--aggregator-timeout", "30", "--port", str(ports),
                     "--control-port", str(ports + 2), *RANKS_ON_CPU)
    yield fed
    fed.close()
    assert fed.service.returncode == 0, (tmp / "serve.log").read_text()[-3000:]  # SIGTERM stops every rank cleanly


def _one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_the_metrics_endpoint_answers_from_the_start_while_no_run_ever_ran(federation):
    fed = federation
    assert RunStore(fed.state).runs() == []  # the module's first test: the service is idle
    _wait_for(lambda: "Prometheus metrics at" in (fed.tmp / "serve.log").read_text(), 30, "no metrics endpoint")
    url = re.search(r"Prometheus metrics at (http://\S+)", (fed.tmp / "serve.log").read_text()).group(1)
    assert "fedpar_agents" in urllib.request.urlopen(url, timeout=10).read().decode()


def test_three_runs_one_stopped_while_the_agents_stay_up_on_both_ranks(federation):
    fed = federation
    store = RunStore(fed.state)  # a reader beside the service (WAL)
    first = fed.submit("plain", f'rounds = 2\nstrategy = "fedavg"\n{QUICK}')
    # the first submit and the listing below as processes (the real command); the other calls from this process
    long = fed.submit("long", f'rounds = 200\nstrategy = "fedprox"\n{QUICK}[strategy_options]\nmu = 0.01\n', here=True)
    third = fed.submit("momentum", f'rounds = 2\nstrategy = "fedavgm"\nplot = false\n{QUICK}', here=True)
    never = fed.submit("never", f"rounds = 1\n{QUICK}", here=True)  # queued behind the others, stopped before it starts
    assert "was queued: stopped" in fed.run_here("stop", str(never)).stdout
    _wait_for(lambda: store.get(long).round >= 1, 240, "the long run never completed a round")
    stopped = fed.run_here("stop", str(long))
    assert stopped.returncode == 0 and "stops at its next check" in stopped.stdout, stopped.stderr
    _wait_for(lambda: store.get(third).status in ("finished", "failed"), 240, "the third run did not end")
    _wait_for(fed.serving, 30, "health is not SERVING between runs")  # the idle coordinator's
    time.sleep(1.5)
    assert fed.serving()  # and stays so

    runs = {run.id: run for run in store.runs()}
    assert [runs[i].status for i in (first, long, third)] == ["finished", "stopped", "finished"], \
        [(r.status, r.reason) for r in runs.values()]
    assert [r["round"] for r in store.round_metrics(first)] == [1, 2]
    assert [r["round"] for r in store.round_metrics(third)] == [1, 2]
    assert 1 <= runs[long].round < 200 and len(store.round_metrics(long)) == runs[long].round
    for run_id in (first, third):
        run = runs[run_id]
        assert Path(run.model_path).is_file() and run.last_metrics["round"] == 2
        assert run.settings["strategy"] in ("fedavg", "fedavgm")
        rows = store.round_metrics(run_id)  # each round on both ranks, the uploads split between them
        assert [r["ranks_live"] for r in rows] == [2, 2], rows
        assert all(r["r0_uploads"] + r["r1_uploads"] == r["reported"] == 2 for r in rows), rows
        # no round waits for an agent still retrying an upload to the stopped run's rank 1 (whose port went with it):
        # its heartbeat replies name another round, so it gives up (a round of the third run took 58 s)
        assert all(r["round_seconds"] < 20 for r in rows), rows
    assert sum(r["r1_uploads"] for run_id in (first, long, third) for r in store.round_metrics(run_id)) > 0
    listing = fed.run("ls")
    assert listing.returncode == 0 and "stopped" in listing.stdout and "finished" in listing.stdout

    logs = fed.run_here("logs", str(first), "-f")
    assert logs.returncode == 0 and logs.stdout.count("round=") == 2 and "is finished" in logs.stdout
    got = fed.run_here("get", str(first), "--out", str(fed.tmp / "got"))
    assert got.returncode == 0, got.stderr
    assert (fed.tmp / "got" / "global.safetensors").read_bytes() == Path(runs[first].model_path).read_bytes()
    assert (fed.tmp / "got" / "metrics.jsonl").is_file()
    # it has no folder: it wrote 'wrote DIR/nothing' and exit 0, or the files in the service's working directory
    _one_line_error(fed.run_here("get", str(never), "--out", str(fed.tmp / "never")),
                    f"run {never} is stopped with no model or metrics to get (stopped by op before it started)")
    assert not (fed.tmp / "never").exists()

    assert all(agent.poll() is None for agent in fed.agents)  # never restarted: the same two processes
    joins = (fed.tmp / "serve.log").read_text().count("agent a1 joined")
    assert joins == 1  # once: its session holds for every run (the agents' port never closed)
    url = re.search(r"Prometheus metrics at (http://\S+)", (fed.tmp / "serve.log").read_text()).group(1)
    exposition = urllib.request.urlopen(url, timeout=10).read().decode()  # one endpoint; the last run's series
    assert f'fedpar_rounds_total{{run="{third}",status="ok"}} 2.0' in exposition, exposition
    assert not any(f'run="{run_id}"' in exposition for run_id in (first, long)), exposition  # dropped: not for ever
    # the stopped run has its plots too (only a signal's stop of the service leaves none)
    assert all((Path(f"{fed.state}.runs") / str(long) / name).is_file() for name in ("accuracy.png", "loss.png"))
    assert not list((Path(f"{fed.state}.runs") / str(third)).glob("*.png"))  # its file said plot = false
    assert runs[third].settings["plot"] is False and runs[first].settings["plot"] is True  # the service's default
    actions = [(a["who"], a["action"]) for a in store.audit_rows()]
    assert actions.count(("op", "submit")) == 4 and ("op", "stop") in actions and ("op", "get") in actions
    for run_id in (first, long, third):  # a TensorBoard folder per run, each with its own rounds
        assert list((fed.tmp / "tb" / f"run-{run_id}").glob("events.out.tfevents.*")), run_id
    assert sorted(p.name for p in (fed.tmp / "tb").iterdir()) == sorted(f"run-{i}" for i in (first, long, third))


def test_bad_control_calls_are_one_line_and_lose_nothing(federation):
    fed = federation
    store = RunStore(fed.state)
    before = len(store.runs())
    for action in (["stop"], ["logs"], ["get", "--out", str(fed.tmp / "nothing")]):
        _one_line_error(fed.run_here(action[0], "9999", *action[1:]), "no run with id 9999")
    assert not (fed.tmp / "nothing").exists()
    unknown = fed.tmp / "unknown.toml"
    unknown.write_text('rounds = 2\nstrategi = "fedavg"\n')
    _one_line_error(fed.run_here("submit", str(unknown)), "unknown run setting(s) strategi")
    bad = fed.tmp / "bad.toml"
    bad.write_text("rounds = -1\n")
    _one_line_error(fed.run_here("submit", str(bad)), "rounds")
    bad.write_text('strategy = "nope"\n')  # checked by the service, as serve checks its flags
    _one_line_error(fed.run_here("submit", str(bad)), "unknown strategy 'nope'")
    operators = fed.certs / "operators"  # an agent's certificate presented as an operator's
    (operators / "intruder.pem").write_bytes((fed.certs / "a1.pem").read_bytes())
    (operators / "intruder.key").write_bytes((fed.certs / "a1.key").read_bytes())
    good = fed.tmp / "good.toml"
    good.write_text(f"rounds = 1\n{QUICK}")
    _one_line_error(fed.run_here("submit", str(good), operator="intruder"), "has no operator role")
    _one_line_error(fed.run_here("ls", operator="intruder"), "has no operator role")
    other = fed.tmp / "other-ca"  # an operator's certificate from another CA: the service would hang up on it
    assert main_here("certs", "--out", str(other), "--operators", "op").returncode == 0
    (operators / "stranger.pem").write_bytes((other / "operators" / "op.pem").read_bytes())
    (operators / "stranger.key").write_bytes((other / "operators" / "op.key").read_bytes())
    _one_line_error(fed.run_here("ls", operator="stranger"), "stranger.pem was not issued by the CA in",
                    "--operators stranger")
    _one_line_error(fed.run_here("ls", "1"), "'fedpar run ls' takes no argument")
    wrong_port = main_here("run", "ls", "--control", f"127.0.0.1:{fed.port}", "--certs", str(fed.certs),
                            "--operator", "op")  # the agents' port
    _one_line_error(wrong_port, "has no control API (is it the agents' port?)")
    agent = subprocess.run([sys.executable, "-m", "fedpar.cli.main", "client", "--server", fed.control, "--certs",
                            str(fed.certs), "--agent-id", "a1", "--give-up-after", "20"], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=120)  # an agent given the control port
    assert agent.returncode != 0 and "not as a coordinator (is it a service's control port?)" in agent.stderr, \
        agent.stderr[-2000:]
    # the state file is the first one's (its lock is the service process's: this process cannot take it either)
    second = main_here("serve", "--state", str(fed.state), "--certs", str(fed.certs), "--port", "0", "--control-port",
                        "0")
    _one_line_error(second, "is in use by another fedpar serve")
    link = fed.tmp / "link.db"  # the same state file by another name
    link.symlink_to(fed.state)
    second = main_here("serve", "--state", str(link), "--certs", str(fed.certs), "--port", "0", "--control-port",
                        "0")
    _one_line_error(second, "is in use by another fedpar serve")
    tracebacks = (fed.tmp / "serve.log").read_text().count("Traceback")
    for text, words in (('[serve]\nrounds = 1\n', ("unknown table(s) [serve]", "[run]")),
                        ('[run]\nrounds = 2\n[serve]\nrounds = 3\n', ("serve outside [run] would be ignored",)),
                        ("rounds = 0\n", ("rounds: 0 is out of range: a count must be at least 1",)),
                        ('dataset = "csv:/nope.csv"\n', ("/nope.csv does not exist",
                                                        "on the service's machine"))):
        bad.write_text(text)
        _one_line_error(fed.run_here("submit", str(bad)), *words)
    assert (fed.tmp / "serve.log").read_text().count("Traceback") == tracebacks  # the service said none either
    piped = subprocess.run(["bash", "-c", f"{sys.executable} -m fedpar.cli.main run ls --control {fed.control} "
                            f"--certs {fed.certs} --operator op | true; exit ${{PIPESTATUS[0]}}"], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=60)
    assert piped.returncode == 141 and piped.stderr == "", piped  # as Unix tools end when their reader left
    assert len(store.runs()) == before and fed.service.poll() is None
    assert ("a1", "refused ls") in [(a["who"], a["action"]) for a in store.audit_rows()]


def test_a_run_whose_every_round_failed_is_failed_and_says_why(federation):
    fed = federation
    store = RunStore(fed.state)
    run_id = fed.submit("short", "rounds = 1\nmin_reports = 5\ndeadline_seconds = 2\nlocal_epochs = 1\n"
                                 "batch_size = 32\n", here=True)
    _wait_for(lambda: store.get(run_id).status in ("finished", "failed", "stopped"), 120, "the run did not end")
    run = store.get(run_id)
    assert run.status == "failed" and run.reason.startswith("every round failed (1 of 1): too few updates arrived"), \
        (run.status, run.reason)
    assert "check min_reports, deadline_seconds" in run.reason


def test_a_revoked_operator_is_refused_on_the_control_port(federation):
    """`fedpar certs --revoke NAME` finds operators too, and the service re-reads revoked.txt at each call."""
    fed = federation
    assert fed.run_here("ls", operator="op2").returncode == 0  # before: an operator like any other
    revoke = subprocess.run([sys.executable, "-m", "fedpar.cli.main", "certs", "--out", str(fed.certs), "--revoke",
                             "op2"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert revoke.returncode == 0 and "revoked operator op2" in revoke.stdout, revoke.stderr
    good = fed.tmp / "good.toml"
    good.write_text(f"rounds = 1\n{QUICK}")
    for action in (["ls"], ["submit", str(good)], ["stop", "1"]):
        _one_line_error(fed.run_here(*action, operator="op2"), "operator 'op2' was revoked")
    assert fed.run_here("ls").returncode == 0  # the others are not
    refused = [a["action"] for a in RunStore(fed.state).audit_rows() if a["who"] == "op2"]
    assert refused[-3:] == ["refused ls", "refused submit", "refused stop"], refused


def _rank_1_pids(log: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"aggregator rank 1 \(pid (\d+)\)", log)]


def test_kill_9_of_rank_1_between_runs_and_in_a_run_then_of_rank_0_costs_no_run_anything(federation):
    """The module's last test on its service (it stops it). Rank 1 killed while no run ran: the next run's start
    failed ('RanksChanged: all-gather ... failed'), the group having found out only then; now it goes on without the
    lost rank and takes its replacement back at a round. Rank 1 killed inside a run: before, the replacement asked to
    join an earlier run (whose rounds were done for good) and left, and the service went on with one rank; the run
    runs until stopped, so the kill falls inside it whatever the machine's speed. Rank 0 (which runs the runs, the
    control API and the agents' port) killed mid-run: its launcher starts every rank again on the same ports, as it
    does for `serve --checkpoint-dir` (QA: the service exited 1, asking the operator to start it again), and the run
    resumes from its last checkpoint. A run after all three has both ranks."""
    fed = federation
    log = fed.tmp / "serve.log"
    taken_back = "rank 1 taken back; going on with 2 of 2 ranks"
    try:
        store = RunStore(fed.state)
        _wait_for(lambda: _rank_1_pids(log.read_text()), 60, "rank 1 did not start")
        _wait_for(lambda: all(run.status not in ("queued", "running") for run in store.runs()), 240,
                  "the earlier tests' runs did not end")
        taken_back_before = log.read_text().count(taken_back)
        killed = [_rank_1_pids(log.read_text())[-1]]
        os.kill(killed[-1], signal.SIGKILL)  # between runs
        _wait_for(lambda: "starting a new process for rank 1" in log.read_text(), 60, "rank 1 was not started again")
        long = fed.submit_rpc("until-stopped", f"rounds = 100000\n{QUICK}")
        _wait_for(lambda: store.get(long).status != "queued", 120, "the run did not start")
        _wait_for(lambda: log.read_text().count(taken_back) > taken_back_before or store.get(long).status != "running",
                  120, "the new rank 1 was not taken back")
        then = store.get(long).round
        _wait_for(lambda: store.get(long).round >= then + 2 or store.get(long).status != "running", 120,
                  "the run stopped going on")
        assert store.get(long).status == "running", store.get(long).reason
        assert store.round_metrics(long)[-1]["ranks_live"] == 2

        killed.append(_rank_1_pids(log.read_text())[-1])  # inside the run
        assert killed[-1] != killed[0]
        os.kill(killed[-1], signal.SIGKILL)
        _wait_for(lambda: log.read_text().count(taken_back) > taken_back_before + 1, 120,
                  "the new rank 1 was not taken back")
        then = store.get(long).round
        _wait_for(lambda: store.get(long).round >= then + 2, 120, "the run stopped going on")
        assert store.get(long).status == "running"  # taken back within the run the kill fell in
        assert store.round_metrics(long)[-1]["ranks_live"] == 2
        assert _rank_1_pids(log.read_text())[-1] not in killed
        assert "Traceback" not in log.read_text(), log.read_text()[-4000:]

        ranks = started(fed.service.pid)
        rank_0 = [p for p in ranks if p != _rank_1_pids(log.read_text())[-1]]
        assert len(rank_0) == 1, ranks
        os.kill(rank_0[0], signal.SIGKILL)
        _wait_for(lambda: "resumed from checkpoint after round" in log.read_text(), 120, "the run did not resume")
        then = store.get(long).round
        # within the rounds' 60 s deadline: an agent whose channel to rank 1 still held the refusal it saw as the
        # ranks died gave its update up as to a dead rank, and the first round after the restart waited out 60 s
        _wait_for(lambda: store.get(long).round >= then + 2, 45, "the resumed run did not go on")
        assert fed.run_here("stop", str(long)).returncode == 0  # the same control port, answering again
        _wait_for(lambda: store.get(long).status == "stopped", 120, "the run did not stop")
        assert store.round_metrics(long)[-1]["ranks_live"] == 2
        text = log.read_text()
        assert "aggregator ranks: rank 0 died (signal SIGKILL); starting every rank again (restart 1 of at most 3 " \
               "an hour)" in text, text[-3000:]
        assert f"run {long} was running when the service last ended: it resumes from its last checkpoint" in text

        after = fed.submit_rpc("after", f"rounds = 2\n{QUICK}")
        _wait_for(lambda: store.get(after).status in ("finished", "failed"), 240, "the run after did not end")
        assert store.get(after).status == "finished", store.get(after).reason
        rows = store.round_metrics(after)
        assert [r["ranks_live"] for r in rows] == [2, 2], rows
        assert sum(r["r1_uploads"] for r in rows) > 0, rows
    finally:
        fed.close()  # as the fixture would (which checks its exit code): no idle service through the other tests


def test_a_corrupt_state_file_is_one_line_and_kept(tmp_path):
    state = tmp_path / "state.db"
    state.write_bytes(b"not a database\n" * 64)
    certs = tmp_path / "certs"  # the flags are checked before the state file: they are right here
    assert main_here("certs", "--out", str(certs), "--agents", "a", "--operators", "op").returncode == 0
    (certs / "revoked.txt").write_text("")
    done = main_here("serve", "--state", str(state), "--certs", str(certs), "--port", "0", "--control-port", "0")
    _one_line_error(done, "is not a fedpar state database or is damaged")
    assert state.read_bytes() == b"not a database\n" * 64 and not (tmp_path / "state.db.lock").exists()


REFERENCE = ("--task", "fedpar.tasks.zoo:classifier", "--task-option", "model=mlp", "--task-option", "dataset=digits")


def test_each_run_samples_only_the_agents_that_have_its_task(tmp_path):
    fed = Federation(tmp_path, ((), REFERENCE), 1)  # a1: the built-in mlp on digits; a2: a --task reference
    try:
        store = RunStore(fed.state)
        log = fed.tmp / "serve.log"
        _wait_for(lambda: log.read_text().count(" joined with ") >= 2, 120, "the agents did not join")
        # agents are connected and none has this task: refused, nothing queued
        cnn = fed.tmp / "cnn.toml"
        cnn.write_text('model = "cnn"\nrounds = 1\n')
        _one_line_error(fed.run_here("submit", str(cnn)), "no connected agent has task 'cnn on digits'", "a2: ")
        assert store.runs() == []

        both = 'rounds = 2\nclients_per_round = 2\nmin_reports = 1\nlocal_epochs = 1\nbatch_size = 32\n'
        builtin = fed.submit("builtin", both, here=True)
        reference = fed.submit("reference", f'task = "fedpar.tasks.zoo:classifier"\n{both}'
                                            '[task_options]\nmodel = "mlp"\ndataset = "digits"\n', here=True)
        _wait_for(lambda: store.get(reference).status in ("finished", "failed", "stopped"), 240,
                  "the second run did not end")
        for run_id, skipped, needed in ((builtin, "a2", "mlp on digits"),
                                        (reference, "a1", "fedpar.tasks.zoo:classifier dataset=digits model=mlp")):
            run = store.get(run_id)
            assert run.status == "finished", run.reason
            rows = store.round_metrics(run_id)
            assert [(r["round"], r["sampled"], r["reported"]) for r in rows] == [(1, 1, 1), (2, 1, 1)], rows
            lines = [entry for kind, _, entry in store.timeline(run_id) if kind == "line"]
            skips = [line for line in lines if "is skipped" in line]
            assert len(skips) == 1 and skips[0].startswith(f"agent {skipped} is skipped: it has task ") \
                and skips[0].endswith(f"this run needs {needed!r}"), lines
            logs = fed.run_here("logs", str(run_id))  # the operator sees the reason beside the rounds
            assert logs.returncode == 0 and skips[0] in logs.stdout and logs.stdout.count("round=") == 2, logs
        assert all(agent.poll() is None for agent in fed.agents)

        # an operator's certificate may not join the agents' port (the control API is its only use)
        files = TlsFiles(fed.certs / "operators" / "op.pem", fed.certs / "operators" / "op.key",
                         fed.certs / "ca.pem")
        with grpc.secure_channel(f"127.0.0.1:{fed.port}", channel_credentials(files)) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                CoordinatorStub(channel).Join(pb.JoinRequest(agent_id="op", num_examples=10), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "has the operator role" in refused.value.details(), refused.value.details()
    finally:
        fed.close()


def test_the_one_shot_form_runs_its_flags_as_one_run_and_leaves_what_it_always_left(tmp_path):
    """`fedpar serve --rounds N` (no --state) is a service of one run, in memory: its --out folder, checkpoints and
    TensorBoard folder are as before, its agents hear that training is over, and it exits 0."""
    from fedpar.server.checkpoint import load_checkpoint

    out, tb, ckpt = tmp_path / "out", tmp_path / "tb", tmp_path / "ckpt"
    serve = _fedpar("serve", "--insecure", "--port", "0", "--port-file", str(tmp_path / "port"), "--out", str(out),
                    "--rounds", "2", "--min-available", "2", "--clients-per-round", "2", "--local-epochs", "1",
                    "--checkpoint-dir", str(ckpt), "--tensorboard", str(tb), "--metrics-port", "0",
                    log=tmp_path / "serve.log")
    agents = []
    try:
        _wait_for(lambda: (tmp_path / "port").exists() or serve.poll() is not None, 60, "serve did not start")
        port = int((tmp_path / "port").read_text())
        agents = [_fedpar("client", "--server", f"127.0.0.1:{port}", "--insecure", "--agent-id", f"a{i}",
                          "--num-partitions", "2", "--partition-index", str(i), "--poll", "1", "--threads", "1",
                          log=tmp_path / f"a{i}.log") for i in range(2)]
        assert serve.wait(120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        assert [agent.wait(30) for agent in agents] == [0, 0]  # told that training is over: they stop
    finally:
        for process in [serve, *agents]:
            if process.poll() is None:
                process.kill()
    log = (tmp_path / "serve.log").read_text()
    assert f"coordinator listening on 127.0.0.1:{port}" in log and "Prometheus metrics at http://" in log
    wrote = rf"^wrote {out}/metrics\.jsonl, .*global\.safetensors.*summary\.json"
    assert '"final": {' in log and re.search(wrote, log, re.M), log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and (out / "metrics.csv").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and not summary["interrupted"]
    assert load_checkpoint(ckpt).round_id == 2 and (out / "global.safetensors").is_file()
    assert list(tb.glob("events.out.tfevents.*")) and not list(tb.glob("run-*"))  # its own folder, not a run's
    assert "run 1" not in log  # the run store's lines are the service's, not this form's


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """One service on one aggregator rank, agent a1 alone at first: a run waiting for agents, then a2 joins for the
    runs across which the agents' port stays serving, then the service is killed -9 at random moments (this order)."""
    fed = Federation(tmp_path_factory.mktemp("one-rank"), ((),), 2)
    yield fed
    fed.close()


def _two_agents_joined(fed: Federation) -> None:
    """Start a2 if only a1 runs; return once both joined."""
    if len(fed.agents) < 2:
        fed.add_agent()
    _wait_for(lambda: (fed.tmp / "serve.log").read_text().count(" joined with ") >= 2, 120, "the agents did not join")


def test_a_run_waiting_for_agents_says_for_how_many_and_who_is_there(one_rank):
    """A run needing two agents while one is joined says so, once on the service's stderr, until it is stopped."""
    fed = one_rank
    assert len(fed.agents) == 1  # one agent, and runs need 2
    store = RunStore(fed.state)
    _wait_for(lambda: " joined with " in (fed.tmp / "serve.log").read_text(), 120, "the agent did not join")
    run_id = fed.submit_rpc("waits", f"rounds = 1\n{QUICK}")
    said = f"run {run_id} waits for 2 agents with task 'mlp on digits': 1 connected with it now (a1), 1 connected"
    _wait_for(lambda: any(said in entry for kind, _, entry in store.timeline(run_id) if kind == "line"), 90,
              f"the run never said it waits: {store.timeline(run_id)}")
    logs = fed.run_here("logs", str(run_id))
    assert logs.returncode == 0 and said in logs.stdout, logs
    assert fed.run_here("stop", str(run_id)).returncode == 0
    _wait_for(lambda: store.get(run_id).status == "stopped", 60, "the run did not stop")
    assert (fed.tmp / "serve.log").read_text().count(f"fedpar service: {said}") == 1  # once on the service's


class HealthProbe:
    """grpc.health.v1 on the agents' port asked every 20 ms from a thread, over one channel: each answer's name
    (SERVING, NOT_SERVING, or the call's status code: UNAVAILABLE when nothing listens)."""

    def __init__(self, fed: Federation):
        files = TlsFiles(fed.certs / "a1.pem", fed.certs / "a1.key", fed.certs / "ca.pem")
        self.channel = grpc.secure_channel(f"127.0.0.1:{fed.port}", channel_credentials(files))
        self.answers: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._ask, daemon=True)
        self._thread.start()

    def _ask(self) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        while not self._done.is_set():
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                self.answers.append(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
            except grpc.RpcError as err:
                self.answers.append(err.code().name)
            time.sleep(0.02)

    def close(self) -> list[str]:
        self._done.set()
        self._thread.join(10)
        self.channel.close()
        return self.answers


def test_the_agents_port_stays_serving_and_the_agents_stay_joined_across_runs(one_rank):
    """idle -> run -> run -> idle: one gRPC server on the agents' port throughout, one registry of agents."""
    fed = one_rank
    probe = None
    try:
        store = RunStore(fed.state)
        log = fed.tmp / "serve.log"
        _two_agents_joined(fed)
        probe = HealthProbe(fed)
        time.sleep(1.0)  # idle
        first = fed.submit_rpc("across-1", f'rounds = 2\nstrategy = "fedavg"\n{QUICK}')
        second = fed.submit_rpc("across-2", f'rounds = 2\nstrategy = "fedadam"\n{QUICK}')
        _wait_for(lambda: store.get(second).status in ("finished", "failed", "stopped"), 240,
                  "the second run did not end")
        time.sleep(2.0)  # idle again
        answers = probe.close()
        assert [store.get(run).status for run in (first, second)] == ["finished", "finished"], \
            [store.get(run).reason for run in (first, second)]
        assert [r["reported"] for run in (first, second) for r in store.round_metrics(run)] == [2, 2, 2, 2]
        assert len(answers) > 50 and set(answers) == {"SERVING"}, \
            {answer: answers.count(answer) for answer in set(answers)}
        assert log.read_text().count("agent a1 joined") == log.read_text().count("agent a2 joined") == 1
        for agent in ("a1", "a2"):  # never dropped: no retry, no new session
            said = (fed.tmp / f"{agent}.log").read_text()
            assert "unreachable" not in said and "joining again" not in said, said[-2000:]
        assert all(agent.poll() is None for agent in fed.agents)
    finally:
        if probe is not None:
            probe.close()


KILL_SEED = int(os.environ.get("FEDPAR_KILL_SEED", "27"))
# Flags the service is restarted with that differ from the first start's defaults: the runs keep the settings they
# were submitted with (a resume under another model's flags would fail, and later rounds would train differently).
RESTARTED_WITH = ("--model", "cnn", "--strategy", "fedprox", "--local-epochs", "1", "--lr", "0.5")


def _rounds_intact(store: RunStore, when: str) -> None:
    """Every run's rounds are 1..its round, each once, and none is past what its settings ask for."""
    for run in store.runs():
        rounds = [r["round"] for r in store.round_metrics(run.id)]
        assert rounds == list(range(1, run.round + 1)) and run.round <= run.settings["rounds"], (when, run, rounds)


def test_kill_9_at_seeded_random_moments_across_runs_loses_no_round_and_resumes(one_rank):
    """The one-rank service killed -9 twice, at seeded moments across two runs, and started again with other flags:
    no round is lost or repeated, each run resumes from its checkpoint with its own settings and finishes."""
    import numpy as np

    from fedpar.server.checkpoint import load_checkpoint
    from fedpar.server.final_model import load_final_model

    rng = random.Random(KILL_SEED)
    fed = one_rank  # the module's last test on it (its earlier runs have ended: their rounds count from here)
    _two_agents_joined(fed)
    store = RunStore(fed.state)
    _wait_for(lambda: all(run.status not in ("queued", "running") for run in store.runs()), 240,
              "the earlier tests' runs did not end")
    earlier = sum(run.round for run in store.runs())
    rounds_take_a_while = QUICK.replace("local_epochs = 1", "local_epochs = 4")  # a kill lands in one too
    planned = {fed.submit_rpc("first", f'rounds = 4\nstrategy = "fedavg"\n{rounds_take_a_while}'): 4,
               fed.submit_rpc("second", f'rounds = 3\nstrategy = "fedadam"\n{rounds_take_a_while}'): 3}
    # after how many finished rounds of all runs each kill comes (mid-run, at a run's end, in the next run),
    # then somewhere in the next round, its checkpoint, or between runs
    kills = [(after, rng.uniform(0.0, 0.3)) for after in sorted(rng.sample(range(1, sum(planned.values())), 2))]
    history = []
    for after, delay in kills:
        _wait_for(lambda: sum(run.round for run in store.runs()) - earlier >= after, 240,
                  f"{after} rounds did not complete (seed {KILL_SEED}, kills {kills}, so far {history})")
        time.sleep(delay)
        fed.service.kill()
        fed.service.wait(10)
        history.append({run.id: (run.status, run.round) for run in store.runs()})
        _rounds_intact(store, f"after kill {len(history)} (seed {KILL_SEED}): {history}")
        fed.service = _fedpar("serve", "--state", str(fed.state), "--certs", str(fed.certs), "--port",
                              str(fed.port), "--control-port", fed.control.rsplit(":", 1)[1], "--min-available",
                              "2", "--heartbeat", "1", *RESTARTED_WITH, log=fed.tmp / "serve.log")
    last = max(planned)
    _wait_for(lambda: store.get(last).status in ("finished", "failed", "stopped"), 240,
              f"the runs did not end after the restarts (seed {KILL_SEED}, kills {kills}: {history})")
    _rounds_intact(store, f"at the end (seed {KILL_SEED}): {history}")
    assert not [run for run in store.runs() if run.status == "running"]
    for run_id, rounds in planned.items():
        run = store.get(run_id)
        assert (run.status, run.round) == ("finished", rounds), (KILL_SEED, history, run.reason)
        assert (run.settings["model"], run.settings["local_epochs"], run.settings["learning_rate"]) == \
            ("mlp", 4, 0.1), run.settings
        names, arrays = load_final_model(Path(run.model_path))  # the model of its last round, as checkpointed
        checkpoint = load_checkpoint(Path(run.out_dir) / "checkpoints")
        assert checkpoint.round_id == rounds and names == checkpoint.names
        assert all(np.array_equal(a, b) for a, b in zip(arrays, checkpoint.arrays))
    resumed = [run_id for run_id in planned if any(h.get(run_id, ("",))[0] == "running" for h in history)]
    lines = {run_id: [e for kind, _, e in store.timeline(run_id) if kind == "line"] for run_id in resumed}
    assert all(any("resumes from its last checkpoint" in line for line in lines[r]) for r in resumed), lines
    assert all(sum(") started: task" in line for line in lines[r]) == 1 and  # started once, then resumed
               any(") resumed: task" in line for line in lines[r]) for r in resumed), lines
    assert all(agent.poll() is None for agent in fed.agents)  # the same agents throughout
