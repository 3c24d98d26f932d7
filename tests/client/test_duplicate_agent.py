"""`fedpar client` started twice with the same --agent-id (a command re-run in a second terminal, two machines given
one certificate): the second is refused in one line and exits non-zero, while the first, a real agent against a real
coordinator over loopback gRPC, keeps its session and trains every round. The rounds wait for one more agent, which
the test speaks for, so that the duplicate comes while the first is joined and its rounds are still to come; then a
process started again under the first one's id once it has stopped gets in at once (the first said goodbye)."""

from __future__ import annotations

import pytest

from fedpar.aggregation import build_strategy
from fedpar.datasets import load_dataset
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.config import CoordinatorConfig
from support.digit_agents import start_digit_agents
from support.in_process import run_main
from support.scripted_agent import ScriptedAgent

ROUNDS = 2


@pytest.mark.timeout(120)  # a duplicate that takes the first one's place runs (and the two trade it) for ever
def test_a_second_agent_with_the_same_id_is_refused_in_one_line_and_the_first_trains_on(tmp_path, capfd):
    rows: list[dict] = []
    server = CoordinatorAssembly.for_data("mlp", load_dataset("digits"), 0, "cpu").server(
        CoordinatorConfig(min_available=2, clients_per_round=2, overselect=1.0, rounds=ROUNDS, deadline_seconds=60.0,
                          heartbeat_seconds=1.0), build_strategy("fedavg"), on_round_end=[rows.append])
    server.start()
    bob = None
    try:
        (alice,), threads, errors = start_digit_agents(server.port, ["alice"], give_up_after=30)
        registry = server.coordinator.registry
        assert threads[0].is_alive() or not errors, errors
        while registry.get("alice") is None:
            assert threads[0].is_alive(), errors
            threads[0].join(0.05)
        session = registry.get("alice")

        second = run_main(["client", "--insecure", "--server", server.address, "--agent-id", "alice", "--dataset",
                           "digits", "--model", "mlp", "--poll", "1", "--max-backoff", "0.5", "--threads", "1",
                           "--device", "cpu"], capfd, tmp_path)

        assert second.returncode == 1, second.stderr
        lines = second.stderr.strip().splitlines()
        coordinator_said = [line for line in lines if " fedpar.server " in line]  # it shares this test's stderr
        assert any("refused a second process for agent 'alice'" in line for line in coordinator_said), lines
        said = [line for line in lines if line not in coordinator_said and "--insecure: plaintext gRPC" not in line]
        assert len(said) == 1 and "Traceback" not in second.stderr, second.stderr  # beside the --insecure warning
        assert said[0].startswith("fedpar client: agent 'alice' is already connected from 127.0.0.1:"), said
        assert said[0].endswith("(its long-poll is open now: that process is running); give each agent its own "
                                "--agent-id, or stop the other one first"), said  # so it was told at once
        assert registry.get("alice") is session  # the first keeps its place, untouched

        bob = ScriptedAgent(server.address, "bob")
        for _ in range(ROUNDS):  # each round waits for bob's update: alice must make hers
            task = bob.task(timeout=60)
            assert bob.upload(task, bob.download(task, server.coordinator.layout), 10,
                              names=server.coordinator.names).accepted
        threads[0].join(60)
        assert not threads[0].is_alive() and not errors, errors
        assert alice.stats.accepted == ROUNDS and alice.stats.reconnects == 0, alice.stats
        assert [(r["status"], r["reported"]) for r in rows] == [("ok", 2)] * ROUNDS, rows

        # alice's process ended, saying goodbye: one started again under her id gets in at once
        again = ScriptedAgent(server.address, "alice")
        assert registry.get("alice").token == again.auth.token != session.token
        again.close()
    finally:
        if bob is not None:
            bob.close()
        server.stop()
