"""One agents' port for many coordinators (server/agent_port.py), as a long-lived service keeps it: its idle
coordinator at the bottom, each run's stacked on it for the run's life, sharing its agents. Real gRPC on loopback;
tests/server/test_run_service.py runs the same through `fedpar serve --state` with real agents."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedpar.aggregation import build_strategy
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.server.agent_port import AgentPort
from fedpar.server.app import CoordinatorServer
from fedpar.server.checkpoint import Checkpoint, save_checkpoint
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator
from fedpar.server.idle_coordinator import idle_server
from fedpar.server.members import CohortSampler
from support.held_restore import held_restore
from support.scripted_agent import ScriptedAgent

QUICK = dict(overselect=1.0, deadline_seconds=30.0, liveness_timeout_seconds=60.0, min_available=1,
             clients_per_round=1, local_epochs=1)


class Service:
    """An open agents' port with the idle coordinator on it, as `fedpar serve --state` opens them."""

    def __init__(self, heartbeat_seconds: float = 1.0):
        self.heartbeat_seconds = heartbeat_seconds
        self.port = AgentPort(CoordinatorConfig(**QUICK, heartbeat_seconds=heartbeat_seconds))
        self.port.open()
        self.idle = idle_server(self.port)
        self.idle.start()
        self.address = f"127.0.0.1:{self.port.port}"

    def run(self, coordinator_class=Coordinator, **config) -> CoordinatorServer:
        """A run's coordinator on the port (not started), with the idle coordinator's agents."""
        coordinator = coordinator_class(
            CoordinatorConfig(**{**QUICK, "heartbeat_seconds": self.heartbeat_seconds, "rounds": 1, **config}),
            ["t0"], [np.zeros(4, np.float32)], build_strategy("fedavg"), members=self.idle.coordinator.members)
        coordinator.keeps_members = True
        return CoordinatorServer(coordinator, agent_port=self.port)

    def health(self) -> str:
        with grpc.insecure_channel(self.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.idle.stop(grace=0.2)
        self.port.close(grace=0.2)


def test_a_session_taken_between_runs_holds_in_every_run_and_after_them():
    service = Service()
    agent = ScriptedAgent(service.address, "a")  # joins the idle coordinator
    try:
        for _ in range(2):
            run = service.run()
            run.start()
            try:
                assert run.port == service.port.port
                task = agent.task()  # the same session: no new Join
                assert agent.upload(task, [np.ones(4, np.float32)], 100).accepted
                assert run.wait(30)
                assert service.health() == "SERVING"
            finally:
                run.stop(grace=0.5)
            assert run.coordinator.metrics.last["reported"] == 1
            assert service.health() == "SERVING"
            reply = agent.stub.Heartbeat(pb.HeartbeatRequest(auth=agent.auth), timeout=5)  # the idle one's again
            assert reply.current_round == 0
        assert service.idle.on_loop(lambda: len(service.idle.coordinator.registry)) == 1
    finally:
        agent.close()
        service.close()


def test_a_long_poll_waiting_on_the_coordinator_beneath_ends_as_a_run_takes_the_calls():
    service = Service(heartbeat_seconds=30.0)
    agent = ScriptedAgent(service.address, "a")
    run = service.run()
    try:
        waiting = agent.stub.PullTask.future(pb.PullTaskRequest(auth=agent.auth, wait_seconds=30.0), timeout=60)
        time.sleep(0.5)  # it waits on the idle coordinator
        started = time.monotonic()
        run.start()
        assert waiting.result(timeout=10).WhichOneof("kind") == "wait_seconds"  # answered at once: nothing there
        assert time.monotonic() - started < 5.0
        assert agent.task(timeout=10).round == 1  # the next poll reaches the run
    finally:
        agent.close()
        run.stop(grace=0.5)
        service.close()


def test_while_a_run_restores_its_checkpoint_the_idle_coordinator_answers(tmp_path):
    save_checkpoint(tmp_path, Checkpoint(1, ["t0"], [np.full(4, 7, np.float32)], {},
                                         {"sampler": CohortSampler(0).state(), "example_caps": {"a": 50},
                                          "strategy": build_strategy("fedavg").state_dict()[1]}))
    HeldRestore, release, restoring = held_restore()

    service = Service()
    run = service.run(HeldRestore, rounds=2, checkpoint_dir=tmp_path)
    starting = threading.Thread(target=run.start)
    starting.start()
    agent = None
    try:
        assert restoring.wait(30)
        agent = ScriptedAgent(service.address, "a", num_examples=500)  # not UNAVAILABLE: the idle one answers
        assert service.health() == "SERVING"
        release.set()
        starting.join(30)
        assert agent.task().round == 2  # the resumed run, with the session taken meanwhile
        registry = run.coordinator.registry
        assert run.on_loop(registry.snapshot) == {"a": 50}  # the run's example caps: its checkpoint's
        assert run.on_loop(lambda: registry.get("a").num_examples) == 50  # and the session taken meanwhile is held
    finally:
        release.set()
        starting.join(30)
        if agent is not None:
            agent.close()
        run.stop(grace=0.5)
        service.close()


def test_a_listening_callback_that_raises_ends_start_instead_of_hanging():
    # `fedpar serve --port-file DIR` waited forever: the port file's write failed on the port's loop, and start()
    # waited for a coordinator that never got to say it was ready
    coordinator = Coordinator(CoordinatorConfig(**QUICK, rounds=1), ["t0"], [np.zeros(4, np.float32)],
                              build_strategy("fedavg"))
    server = CoordinatorServer(coordinator)

    def cannot_write(port: int) -> None:
        raise IsADirectoryError(21, "Is a directory", "run/port")

    server.on_listening = cannot_write
    started = time.monotonic()
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            server.start()
        except BaseException as exc:
            outcome.append(exc)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    starting.join(10)
    assert not starting.is_alive(), "start() hangs"
    assert isinstance(outcome[0], IsADirectoryError) and time.monotonic() - started < 10
    server.stop(grace=0.2)


def test_an_ipv6_host_is_bracketed_as_grpc_takes_it():
    # serve --host ::1 built '::1:0', which gRPC could not bind ('Failed to add port'), and told agents to dial it
    from fedpar.protocol.codec import grpc_target

    assert grpc_target("::1", 50051) == "[::1]:50051"
    assert grpc_target("[::1]", 0) == "[::1]:0"
    assert grpc_target("127.0.0.1", 0) == "127.0.0.1:0" and grpc_target("localhost", 7) == "localhost:7"


def test_an_update_of_a_stopped_run_is_refused_as_its_run_ended_and_the_agent_says_so_calmly(caplog):
    # After 'fedpar run stop', an agent's last upload reached the idle coordinator, which said "upload for round 1,
    # but the current round is 0", and the agent logged it as "upload refused: FAILED_PRECONDITION: ...".
    import logging
    import random

    from fedpar.client.compressed import PreparedUpload
    from fedpar.client.local_loop import TrainResult
    from fedpar.client.transfer import UpdateSender, upload_small
    from fedpar.protocol.codec import ModelLayout

    service = Service()
    agent = ScriptedAgent(service.address, "a")
    try:
        run = service.run(rounds=2)
        run.start()
        try:
            task = agent.task()
        finally:
            run.stop(grace=0.5)  # stopped mid-round: the idle coordinator takes the agents' calls again
        with pytest.raises(grpc.RpcError) as err:
            agent.upload(task, [np.ones(4, np.float32)], 100)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no run is in progress on this service: the run it was for ended" in err.value.details(), \
            err.value.details()
        assert "current round is 0" not in err.value.details()
        noted = []
        sender = UpdateSender(agent.auth, task, agent.stub, upload_small, time.monotonic() + 30, 1 << 20, 1 << 20,
                              1 << 20, random.Random(0), lambda what, why: noted.append((what, why)))
        arrays = [np.ones(4, np.float32)]
        with caplog.at_level(logging.INFO, logger="fedpar.client"):
            sent = sender.send(PreparedUpload(ModelLayout.of_arrays(["t0"], arrays), arrays),
                               TrainResult(steps=1, examples=100, loss=0.5, stopped_early=False, seconds=0.1), {},
                               time.monotonic() + 30)
        assert not sent and noted == []  # not counted as a refusal
        said = [r for r in caplog.records if r.name.startswith("fedpar.client")]
        assert [(r.levelno, r.getMessage()) for r in said] == [
            (logging.INFO, f"a: round {task.round}'s update was not used: its run ended (finished or stopped) before "
                           "it arrived")], said
    finally:
        agent.close()
        service.close()
