"""A ClientApp that fails a ServerApp's train Message sends Flower's error reply, and its agent counts that task as
failed, with the reason, never as an accepted update: `fedpar serve --flower-app` in its own process, two agents'
client runtimes (cli/agent.py's, as `fedpar client --flower-app` makes them) in this one, over gRPC on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support.processes import port_from

pytest.importorskip("flwr")

ROOT = Path(__file__).resolve().parents[2]
APP = Path(__file__).parent / "tiny_app"
FEDPAR = [sys.executable, "-m", "fedpar.cli.main"]


def _agent(port: int, agent_id: str, partition: int):
    """The client runtime `fedpar client --flower-app APP` runs for partition ``partition`` of 2."""
    from fedpar.cli.agent import flower_app_agent
    from fedpar.cli.agent_setup import agent_config
    from fedpar.cli.main import build_parser
    from fedpar.cli.tlsopts import client_security

    args = build_parser("client").parse_args(
        ["client", "--server", f"127.0.0.1:{port}", "--insecure", "--agent-id", agent_id, "--num-partitions", "2",
         "--partition-index", str(partition), "--flower-app", str(APP), "--give-up-after", "60"])
    return flower_app_agent(args, agent_config(args, client_security(args)))


def test_error_replies_to_train_messages_count_as_failed_tasks_not_accepted_updates(tmp_path):
    serve = subprocess.Popen([*FEDPAR, "serve", "--insecure", "--port", "0", "--min-available", "2", "--flower-app",
                              str(APP), "--run-config", "fail-partition=1", "--out", str(tmp_path / "run")],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        port = port_from(serve, lines, "(PLAINTEXT (--insecure)) for Flower App")
        agents = [_agent(port, "alice", 0), _agent(port, "bob", 1)]
        stats: dict[str, object] = {}
        threads = [threading.Thread(target=lambda a=a: stats.__setitem__(a.config.agent_id, a.run()), daemon=True)
                   for a in agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        serve_out = "".join(lines) + serve.communicate(timeout=60)[0]
    finally:
        if serve.poll() is None:
            serve.kill()
    assert serve.returncode == 0 and set(stats) == {"alice", "bob"}, serve_out[-3000:]
    alice, bob = stats["alice"], stats["bob"]
    # 2 server rounds, each a train and an evaluate Message: bob's ClientApp fails both train messages
    # (Messages answered by type, not accepted updates: a Flower App agent uploads none)
    assert (alice.tasks, alice.answered, alice.accepted, alice.refused) == (4, {"train": 2, "evaluate": 2}, 0, 0), \
        alice.refusals
    assert (bob.tasks, bob.answered, bob.accepted, bob.refused) == (4, {"evaluate": 2}, 0, 2), bob.refusals
    assert bob.refusals == [f"round {r} message: ClientApp train handler failed: RuntimeError: this partition fails "
                            "on purpose" for r in (1, 3)], bob.refusals


def _train_message() -> bytes:
    """A ServerApp's train Message to client-0000's node, as fedpar's wire carries it."""
    import time

    from flwr.app import ConfigRecord, Message, Metadata, RecordDict

    from fedpar.protocol.flower_nodes import SERVER_NODE_ID, node_id_of
    from fedpar.protocol.flower_wire import encode_message

    metadata = Metadata(run_id=1, message_id="m-1", src_node_id=SERVER_NODE_ID, dst_node_id=node_id_of("client-0000"),
                        reply_to_message_id="", group_id="1", created_at=time.time(), ttl=60.0, message_type="train")
    return encode_message(Message(content=RecordDict({"config": ConfigRecord({"lr": 0.1})}), metadata=metadata))


def _raises(message, context):
    raise RuntimeError("no data here")


def _replies_with_an_error(message, context):
    from flwr.app import Error, Message

    return Message(Error(code=5, reason="a client mod said no"), reply_to=message)


@pytest.mark.parametrize("client_app, said", [
    (_raises, "ClientApp train handler failed: RuntimeError: no data here"),
    (_replies_with_an_error, "ClientApp train reply carries an error: a client mod said no")])
def test_an_answer_that_is_flowers_error_reply_says_why(client_app, said):
    """A ClientApp that replies with an error of its own was counted as an accepted update too."""
    from fedpar.client.flower_app_member import answer_message
    from fedpar.protocol.flower_wire import decode_message

    answer = answer_message(client_app, _train_message(), 1 << 20, "client-0000", lambda run_id: None)
    assert answer.error == said
    reply = decode_message(answer.data, 1 << 20)
    assert reply.has_error() and reply.metadata.reply_to_message_id == "m-1"
