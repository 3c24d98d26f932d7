"""A service's run samples only the agents that declared its task at Join; each other one is named once, with why.
(tests/server/test_run_service.py runs the same with real agents over gRPC.)"""

import argparse

from fedpar.cli.task_options import task_label
from fedpar.server.config import CoordinatorConfig
from fedpar.server.members import Members
from fedpar.server.registry import AgentRegistry


def test_only_agents_declaring_the_runs_task_are_sampled_and_the_others_named_once():
    members = Members(CoordinatorConfig(), AgentRegistry(liveness_timeout=60.0))
    said = []
    members.require_task("mlp on digits", lambda agent, why: said.append((agent, why)),
                         known={"gone": "cnn on digits", "a1": "mlp on digits"})  # as the last coordinator knew them
    members.join("a1", 10, {"framework": "torch", "task": "mlp on digits"})
    members.join("a2", 10, {"framework": "torch", "task": "cnn on digits"})
    members.join("a3", 10, {"framework": "torch"})  # says nothing: it may not have the task
    members.join("a2", 10, {"framework": "torch", "task": "cnn on digits"})  # a re-join is not named again
    assert members.live_ids() == ["a1"]
    assert [agent for agent, _ in said] == ["gone", "a2", "a3"]
    assert said[1][1] == "agent a2 is skipped: it has task 'cnn on digits', this run needs 'mlp on digits'"
    assert "did not say which task it has" in said[2][1]
    assert members.declared_tasks() == {"a1": "mlp on digits", "a2": "cnn on digits", "a3": None}

    members.join("a2", 10, {"framework": "torch", "task": "mlp on digits"})  # restarted with the task
    assert members.live_ids() == ["a1", "a2"]


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
