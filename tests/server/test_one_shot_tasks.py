"""One-shot `fedpar serve` samples no agent whose declared task (model and data) differs from its own: such an agent
is refused its Join in one line naming both tasks and what to do, which serve says too, and the agent exits 1. Before,
it was sampled, refused every download ('expected 4 tensors, got 8'), exited 0, and serve's rounds all failed. An
agent that declares no task (an older fedpar) is sampled as before, and so are agents whose --task options or data
file names are their site's own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedpar.cli.serve_once import same_task
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import PROTOCOL_VERSION, CoordinatorStub
from support.in_process import run_main

ROOT = Path(__file__).resolve().parents[2]
FEDPAR = [sys.executable, "-m", "fedpar"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
REFUSED = ("agent a cannot take part: it has task 'mlp on digits', this run needs 'cnn on digits'; start the agent "
           "with the coordinator's --model cnn --dataset digits")


def _port(serve: subprocess.Popen, port_file: Path) -> int:
    end = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text().strip():
        assert serve.poll() is None and time.monotonic() < end, serve.communicate()[0]
        time.sleep(0.05)
    return int(port_file.read_text())


def test_one_shot_serve_refuses_an_agent_with_another_model_in_one_line_and_trains_with_the_one_that_has_it(
        tmp_path, capfd):
    serve = subprocess.Popen([*FEDPAR, "serve", "--insecure", "--port", "0", "--port-file", str(tmp_path / "port"),
                              "--rounds", "1", "--min-available", "1", "--clients-per-round", "1", "--model", "cnn",
                              "--deadline", "60", "--out", str(tmp_path / "out")], cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    agents = []
    try:
        address = f"127.0.0.1:{_port(serve, tmp_path / 'port')}"
        client = ["client", "--server", address, "--insecure", "--threads", "1", "--poll", "1", "--give-up-after",
                  "20"]
        # a, the default mlp: its refusal by the client's main in this process; b, once a is gone, a process that
        # trains
        refused = run_main([*client, "--agent-id", "a"], capfd, cwd=tmp_path)
        agents.append(subprocess.Popen([*FEDPAR, *client, "--agent-id", "b", "--model", "cnn"], cwd=tmp_path,
                                       text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV))
        b_out, b_err = agents[-1].communicate(timeout=90)
        served, serve_err = serve.communicate(timeout=60)
    finally:
        for process in (serve, *agents):
            if process.poll() is None:
                process.kill()
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stdout + refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == \
        f"fedpar client: a: coordinator refused: FAILED_PRECONDITION: {REFUSED}"
    assert "tasks," not in refused.stdout, refused.stdout  # no task reached it
    assert agents[0].returncode == 0 and "b: 1 task, 1 update accepted, 0 refused" in b_out, b_out + b_err
    assert serve.returncode == 0 and "Traceback" not in serve_err, served + serve_err
    # a warning: serve goes on (its 'fedpar serve: ...' lines alone are those it stops with)
    assert [line for line in serve_err.splitlines() if "cannot take part" in line] == [
        f"fedpar serve: warning: {REFUSED}; this run goes on without it"]


def test_which_declared_tasks_one_shot_serve_takes():
    assert same_task("mlp on digits", "mlp on digits")
    assert not same_task("mlp on digits", "cnn on digits")
    assert not same_task("mlp on digits", "mlp on mnist")  # the --dataset mnist coordinator's 784 inputs
    assert same_task("mlp on csv:site-a.csv", "mlp on csv:data.csv")  # each site names its own file
    assert not same_task("mlp on csv:data.csv", "mlp on digits")
    assert same_task("speech.py:make data=/srv/a", "speech.py:make data=/srv/b")  # a site's own option
    assert not same_task("speech.py:make", "other.py:make")
    assert not same_task("speech.py:make", "mlp on digits")


def _join(stub: CoordinatorStub, agent_id: str, task: str | None) -> pb.JoinReply:
    return stub.Join(pb.JoinRequest(agent_id=agent_id, num_examples=10, protocol_version=PROTOCOL_VERSION,
                                    capabilities={"framework": "torch", **({"task": task} if task else {})}),
                     timeout=10)


def _one_shot(server, task: str) -> list[str]:
    """``server``'s members set up as cli/serve_once.py sets them up before its coordinator takes calls, for a run of
    ``task`` started with --model mlp --dataset digits: the lines naming those refused, as they come."""
    said: list[str] = []
    members = server.coordinator.members

    def one_shot() -> None:
        members.refuse_other_tasks("--model mlp --dataset digits", same_task)
        members.require_task(task, lambda agent, why: said.append(why))

    server.on_loop(one_shot)
    return said


def test_an_agent_that_declares_no_task_is_sampled_and_one_with_another_is_refused_its_join(start_coordinator):
    server = start_coordinator([np.zeros(4, np.float32)], clients_per_round=9, min_available=9, rounds=1)
    members = server.coordinator.members
    said = _one_shot(server, "mlp on csv:data.csv")
    channel = grpc.insecure_channel(server.address)
    stub = CoordinatorStub(channel)
    try:
        _join(stub, "old", None)  # an older fedpar says nothing
        _join(stub, "site", "mlp on csv:site.csv")
        for _ in range(2):  # named once on serve's side; refused each time
            with pytest.raises(grpc.RpcError) as refused:
                _join(stub, "other", "cnn on csv:data.csv")
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details() == ("agent other cannot take part: it has task 'cnn on csv:data.csv', this run "
                                           "needs 'mlp on csv:data.csv'; start the agent with the coordinator's "
                                           "--model mlp --dataset digits")
        assert said == [refused.value.details()]
        assert server.on_loop(members.live_ids) == ["old", "site"]
        _join(stub, "other", "mlp on csv:data.csv")  # started again with the run's task
        assert server.on_loop(members.live_ids) == ["old", "other", "site"]
    finally:
        channel.close()


def test_a_simulation_host_with_another_task_is_refused_its_join_and_none_of_its_members_is_sampled(
        start_coordinator):
    from support.population_calls import join_members

    server = start_coordinator([np.zeros(4, np.float32)], accept_populations=True, clients_per_round=2,
                               min_available=9, rounds=1)
    members = server.coordinator.members
    said = _one_shot(server, "mlp on digits")
    channel = grpc.insecure_channel(server.address)
    stub = CoordinatorStub(channel)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            join_members(stub, "h-cnn", ["c0", "c1"], capabilities={"task": "cnn on digits"})
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details() == ("simulation host h-cnn cannot take part: it has task 'cnn on digits', this "
                                           "run needs 'mlp on digits'; start it with the coordinator's --model mlp "
                                           "--dataset digits")
        assert said == [refused.value.details()]
        join_members(stub, "h-mlp", ["m0", "m1"], capabilities={"task": "mlp on digits"})
        assert server.on_loop(members.live_ids) == ["m0", "m1"]  # not c0, c1
        join_members(stub, "h-cnn", ["c0", "c1"], capabilities={"task": "mlp on digits"})  # started again, right
        assert server.on_loop(members.live_ids) == ["c0", "c1", "m0", "m1"]
    finally:
        channel.close()
