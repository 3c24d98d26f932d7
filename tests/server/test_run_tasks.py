"""A service's run samples only the agents that declared its task at Join; each other one is named once, with why.
(tests/server/test_run_service.py runs the same with real agents over gRPC.)"""

import argparse

import pytest

from fedpar.cli.task_options import task_label
from fedpar.server.config import CoordinatorConfig
from fedpar.server.members import Members
from fedpar.server.registry import AgentRegistry, SessionClaim


def test_only_agents_declaring_the_runs_task_are_sampled_and_the_others_named_once():
    members = Members(CoordinatorConfig(), AgentRegistry(liveness_timeout=60.0))
    members.join("a0", 10, {"framework": "torch", "task": "cnn on digits"})  # joined before the run (the last one's)
    said = []
    members.require_task("mlp on digits", lambda agent, why: said.append((agent, why)))
    members.join("a1", 10, {"framework": "torch", "task": "mlp on digits"})
    a2 = members.join("a2", 10, {"framework": "torch", "task": "cnn on digits"})
    members.join("a3", 10, {"framework": "torch"})  # says nothing: it may not have the task
    a2 = members.join("a2", 10, {"framework": "torch", "task": "cnn on digits"},
                      claim=SessionClaim(replaces_token=a2.token))  # a re-join (its session presented): not named again
    assert members.live_ids() == ["a1"]
    assert [agent for agent, _ in said] == ["a0", "a2", "a3"]
    assert said[1][1] == "agent a2 is skipped: it has task 'cnn on digits', this run needs 'mlp on digits'"
    assert "did not say which task it has" in said[2][1]
    assert members.declared_tasks() == {"a0": "cnn on digits", "a1": "mlp on digits", "a2": "cnn on digits",
                                        "a3": None}

    members.leave("a2")  # its process stopped: another (restarted with the task) takes its place
    members.join("a2", 10, {"framework": "torch", "task": "mlp on digits"})
    assert members.live_ids() == ["a1", "a2"]
    said.clear()  # the next run: the agents that stay joined are checked against its task, each named once
    members.require_task("cnn on digits", lambda agent, why: said.append((agent, why)))
    assert members.live_ids() == ["a0"] and [agent for agent, _ in said] == ["a1", "a2", "a3"]


def test_without_a_required_task_every_agent_is_sampled():
    members = Members(CoordinatorConfig(), AgentRegistry(liveness_timeout=60.0))
    members.join("a1", 10, {"task": "mlp on digits"})
    members.join("a2", 10, {})
    assert list(members.live_ids()) == ["a1", "a2"]


def test_a_task_is_named_the_same_on_every_site():
    plain = argparse.Namespace(task=None, model="mlp", dataset="digits", task_options={})
    assert task_label(plain) == "mlp on digits"
    table = argparse.Namespace(task=None, model="mlp", dataset="csv:/srv/site-a/data.csv", task_options={})
    assert task_label(table) == "mlp on csv:data.csv"  # each site keeps its file where it likes
    here = argparse.Namespace(task="/home/alice/tasks/speech.py:make", model="mlp", dataset="digits",
                              task_options={"width": 64, "depth": "2"})
    there = argparse.Namespace(task="./speech.py:make", model="cnn", dataset="mnist",
                               task_options=["depth=2", "width=64"])  # as --task-option gives them
    assert task_label(here) == task_label(there) == "speech.py:make depth=2 width=64"
    # a data path among the options is each site's own too (QA: sites whose copies sat at other paths never matched)
    site_a = argparse.Namespace(task="own_task.py:task", model="mlp", dataset="digits",
                                task_options=["csv=/work/examples/table.csv", "ratio=1/2", "folder=./shards"])
    site_b = argparse.Namespace(task="own_task.py:task", model="mlp", dataset="digits",
                                task_options=["csv=/tmp/site2/table.csv", "ratio=1/2", "folder=../data/shards"])
    assert task_label(site_a) == task_label(site_b) == "own_task.py:task csv=table.csv folder=shards ratio=1/2"
    other = argparse.Namespace(task="own_task.py:task", model="mlp", dataset="digits",
                               task_options=["csv=/tmp/site2/other.csv", "ratio=3/4", "folder=../data/shards"])
    assert task_label(other) == "own_task.py:task csv=other.csv folder=shards ratio=3/4"


def test_a_run_samples_only_the_members_of_simulation_hosts_that_declare_its_task(start_coordinator):
    """Over gRPC: each host declares its members' task at JoinPopulation; the others' members are never sampled."""
    import grpc
    import numpy as np

    from fedpar.protocol import fedpar_pb2 as pb
    from support.population_calls import host_stub, join_members, pull_tasks

    server = start_coordinator([np.zeros(4, np.float32)], accept_populations=True, clients_per_round=9,
                               min_available=3, rounds=1)
    said = []
    server.on_loop(lambda: server.coordinator.members.require_task("mlp on digits",
                                                                   lambda host, why: said.append((host, why))))
    stub = host_stub(server)

    def join(host: str, capabilities: dict, token: str = "") -> pb.JoinPopulationReply:
        return join_members(stub, host, [f"{host}-{i}" for i in range(3)], token, capabilities=capabilities)

    other = join("b", {"task": "cnn on digits"})
    join("c", {})  # says nothing: it may not have the task
    mine = join("a", {"task": "mlp on digits"})
    got = []
    for _ in range(20):
        got += pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="a", token=mine.host_token),
                                                          wait_seconds=0.5), timeout=10).tasks
        if len(got) == 3:
            break
    assert sorted(t.agent_id for t in got) == ["a-0", "a-1", "a-2"]  # the whole cohort: the other hosts' are out
    assert not pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="b", token=other.host_token),
                                                          wait_seconds=0.2), timeout=10).tasks
    assert said == [("b", "simulation host b is skipped: it has task 'cnn on digits', this run needs 'mlp on digits'"),
                    ("c", "simulation host c is skipped: it did not say which task it has (an older fedpar?), this "
                          "run needs 'mlp on digits'")]
    members = server.coordinator.members
    assert server.on_loop(members.declared_tasks) == {"a": "mlp on digits", "b": "cnn on digits", "c": None}
    join("b", {"task": "mlp on digits"}, other.host_token)  # restarted with the task: its members are back
    assert server.on_loop(members.live_ids) == [f"{h}-{i}" for h in "ab" for i in range(3)]
    with pytest.raises(grpc.RpcError) as refused:
        join("d", {"task": "x" * 300})
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "capabilities" in refused.value.details()


@pytest.mark.timeout(120)  # a host that declared no task would wait for ever
def test_a_simulation_host_declares_the_task_its_members_train_and_a_run_that_needs_it_samples_them():
    import numpy as np

    from fedpar.aggregation import build_strategy
    from fedpar.datasets import load_dataset
    from fedpar.datasets.members import member_source
    from fedpar.server.assembly import CoordinatorAssembly
    from fedpar.simulations.agents import WorkerConfig, worker_task
    from fedpar.simulations.population import PopulationSlice, host_population

    splits = load_dataset("digits")
    rows: list[dict] = []
    server = CoordinatorAssembly.for_data("mlp", splits, 0, None).server(
        CoordinatorConfig(rounds=1, clients_per_round=4, min_available=4, accept_populations=True, local_epochs=1,
                          deadline_seconds=60.0, heartbeat_seconds=1.0), build_strategy("fedavg"),
        on_round_end=[rows.append])
    said = []
    server.coordinator.members.require_task("mlp on digits", lambda host, why: said.append(why))
    server.start()
    try:
        population = PopulationSlice.of("host-0", np.arange(4), member_source(splits, "iid", 4, 0).sizes,
                                        np.zeros(4))
        worker = WorkerConfig(server=server.address, population=population, clients=4, device="cpu")
        host_population(server.address, population, worker_task(worker, splits), worker.partition_of, 0, seats=2,
                        poll_seconds=1.0, task_name=task_label(worker)).run()  # as simulate's workers declare it
    finally:
        server.stop()
    assert [(r["status"], r["reported"]) for r in rows] == [("ok", 4)] and said == []
