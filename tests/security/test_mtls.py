"""Transport security and identity over real gRPC on 127.0.0.1 with real certificates: mutual TLS rounds,
foreign CAs, plaintext agents, certificate/agent-id mismatches, allow-lists, enrollment tokens, revocation."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from fedpar.client.agent import Agent, AgentConfig, FatalAgentError
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import ArrayDataset
from fedpar.models import get_weights, weight_specs
from fedpar.models.mlp import MLP
from fedpar.security.admission import Admission, RevocationList, TokenList, append_revocation, mint_token
from fedpar.security.certs import load_certificate
from fedpar.security.tls import TlsFiles, channel_credentials, server_credentials



def _rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _local_data(seed: int, n: int = 40) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.standard_normal((n, 4)).astype(np.float32) + 2.0 * np.eye(4, dtype=np.float32)[y]
    return ArrayDataset(x, y)


def test_full_round_over_mutual_tls_with_two_real_agents(pki, coordinator_factory):
    torch.manual_seed(0)
    model = MLP(in_features=4, hidden=(8,), num_classes=3)
    init = get_weights(model)
    server = coordinator_factory(pki.server_credentials(), Admission(require_certificate=True),
                                 weights=init, names=[n for n, _, _ in weight_specs(model)], rounds=2,
                                 min_available=2, clients_per_round=2, local_epochs=1, batch_size=8, learning_rate=0.1)
    coordinator = server.coordinator
    agents = []
    for i, agent_id in enumerate(["alice", "bob"]):
        local = MLP(in_features=4, hidden=(8,), num_classes=3)
        config = AgentConfig(server=server.address, agent_id=agent_id, poll_seconds=1.0, give_up_after=20.0,
                             credentials=pki.agent_credentials(agent_id))
        agents.append(Agent(config, LocalTrainer(local, _local_data(i))))
    results: dict[str, object] = {}
    threads = [threading.Thread(target=lambda a=a: results.__setitem__(a.config.agent_id, a.run()))
               for a in agents]
    for t in threads:
        t.start()
    assert server.wait(60)
    for t in threads:
        t.join(30)
    rows = list(coordinator.metrics.read_rows())
    assert [(r["status"], r["sampled"], r["reported"]) for r in rows] == [("ok", 2, 2), ("ok", 2, 2)]
    assert {k: (s.accepted, s.refused) for k, s in results.items()} == {"alice": (2, 0), "bob": (2, 0)}
    assert any(not np.array_equal(a, b) for a, b in zip(coordinator.weights, init))
    for agent_id in ("alice", "bob"):  # the registry remembers which certificate each agent proved
        serial = load_certificate(pki.paths.agent_cert(agent_id)).serial_number
        assert coordinator.registry.get(agent_id).cert_serial == serial


def test_agent_with_a_certificate_from_a_foreign_ca_cannot_connect(pki, coordinator_factory, raw_agents):
    server = coordinator_factory(pki.server_credentials(), Admission(require_certificate=True),
                                 min_available=9)
    foreign_cert = TlsFiles(pki.foreign / "alice.pem", pki.foreign / "alice.key", pki.paths.ca_cert)
    intruder = raw_agents(server.address, channel_credentials(foreign_cert))
    assert _rpc_error(lambda: intruder.join("alice")).code() == grpc.StatusCode.UNAVAILABLE
    # An agent that trusts only the foreign CA refuses our coordinator's certificate as well.
    wrong_trust = TlsFiles(pki.paths.agent_cert("alice"), pki.paths.agent_key("alice"), pki.foreign / "ca.pem")
    lost = raw_agents(server.address, channel_credentials(wrong_trust))
    assert _rpc_error(lambda: lost.join("alice")).code() == grpc.StatusCode.UNAVAILABLE
    assert len(server.coordinator.registry) == 0


def test_plaintext_or_certificateless_agent_cannot_talk_to_a_tls_coordinator(pki, coordinator_factory, raw_agents):
    server = coordinator_factory(pki.server_credentials(), Admission(require_certificate=True),
                                 min_available=9)
    plaintext = raw_agents(server.address, None)
    assert _rpc_error(lambda: plaintext.join("alice")).code() == grpc.StatusCode.UNAVAILABLE
    no_cert = raw_agents(server.address, channel_credentials(TlsFiles(None, None, pki.paths.ca_cert)))
    assert _rpc_error(lambda: no_cert.join("alice")).code() == grpc.StatusCode.UNAVAILABLE
    assert len(server.coordinator.registry) == 0


def test_certificate_of_alice_cannot_claim_to_be_bob(pki, coordinator_factory, raw_agents):
    server = coordinator_factory(pki.server_credentials(), Admission(require_certificate=True),
                                 min_available=9)
    alice = raw_agents(server.address, pki.agent_credentials("alice"))
    err = _rpc_error(lambda: alice.join("bob"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "proves agent 'alice'" in err.details() and "'bob'" in err.details()
    assert server.coordinator.registry.get("bob") is None
    # Later calls too: alice's connection cannot use bob's (stolen) session token.
    bob = raw_agents(server.address, pki.agent_credentials("bob"))
    bob.join("bob")
    err = _rpc_error(lambda: alice.heartbeat(bob.auth))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "proves agent 'alice'" in err.details()
    assert bob.heartbeat().current_round == 0  # bob himself is fine


def test_agent_off_the_allow_list_is_refused(pki, coordinator_factory, raw_agents):
    server = coordinator_factory(pki.server_credentials(),
                                 Admission(allowed_ids={"alice"}, require_certificate=True), min_available=9)
    bob = raw_agents(server.address, pki.agent_credentials("bob"))
    err = _rpc_error(lambda: bob.join("bob"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "allow-list" in err.details()
    raw_agents(server.address, pki.agent_credentials("alice")).join("alice")
    assert list(server.coordinator.registry.snapshot()) == ["alice"]


@pytest.mark.parametrize("transport", ["server-only TLS", "plaintext"])
def test_enrollment_tokens_admit_only_the_agent_they_were_minted_for(pki, coordinator_factory, raw_agents, tmp_path,
                                                                     transport):
    tokens_file = tmp_path / "tokens.txt"
    dave_token, erin_token = mint_token(tokens_file, "dave"), mint_token(tokens_file, "erin")
    assert dave_token not in tokens_file.read_text()  # only hashes are stored
    admission = Admission(token_hashes=TokenList(tokens_file))
    if transport == "plaintext":
        server_creds = client_creds = None
    else:
        server_creds = server_credentials(TlsFiles(pki.paths.server_cert, pki.paths.server_key, None))
        client_creds = channel_credentials(TlsFiles(None, None, pki.paths.ca_cert))
    server = coordinator_factory(server_creds, admission, min_available=9)
    agent = raw_agents(server.address, client_creds)
    for token, word in (("", "missing"), ("not-the-token", "wrong"), (erin_token, "wrong")):
        err = _rpc_error(lambda: agent.join("dave", token=token))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and f"{word} enrollment token" in err.details()
    assert len(server.coordinator.registry) == 0
    agent.join("dave", token=dave_token)
    assert agent.heartbeat().current_round == 0
    assert server.coordinator.registry.get("dave") is not None
    frank_token = mint_token(tokens_file, "frank")  # enrolled while the coordinator runs: no restart needed
    raw_agents(server.address, client_creds).join("frank", token=frank_token)
    assert sorted(server.coordinator.registry.snapshot()) == ["dave", "frank"]


def test_revoked_agent_is_refused_on_its_next_call_and_not_sampled_again(pki, coordinator_factory, raw_agents,
                                                                         tmp_path):
    revoked = tmp_path / "revoked.txt"
    server = coordinator_factory(pki.server_credentials(),
                                 Admission(revocations=RevocationList(revoked), require_certificate=True),
                                 rounds=2, min_available=2, clients_per_round=2)
    coordinator = server.coordinator
    layout = coordinator.layout
    alice, bob = (raw_agents(server.address, pki.agent_credentials(a)) for a in ("alice", "bob"))
    alice.join("alice")
    bob.join("bob")
    alice_task, bob_task = alice.task(), bob.task()
    assert bob.train_and_upload(bob_task, coordinator.names, layout).accepted
    append_revocation(revoked, agent_id="bob")  # the operator revokes bob while round 1 is still open
    for call in (bob.heartbeat, bob.pull, lambda: bob.join("bob")):
        err = _rpc_error(call)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "'bob' was revoked" in err.details()
    assert alice.train_and_upload(alice_task, coordinator.names, layout).accepted  # closes round 1
    carol = raw_agents(server.address, pki.agent_credentials("carol"))
    carol.join("carol")
    alice_task, carol_task = alice.task(), carol.task()
    assert alice_task.round == carol_task.round == 2
    assert sorted(coordinator.current.slots) == ["alice", "carol"]  # bob, though still "live", is not sampled
    assert coordinator.registry.live_ids() == ["alice", "carol"]
    for agent, task in ((alice, alice_task), (carol, carol_task)):
        assert agent.train_and_upload(task, coordinator.names, layout).accepted
    assert server.wait(30)
    assert [(r["round"], r["sampled"], r["reported"]) for r in coordinator.metrics.read_rows()] == \
        [(1, 2, 2), (2, 2, 2)]


def test_revoking_one_certificate_serial_refuses_that_certificate(pki, coordinator_factory, raw_agents, tmp_path):
    revoked = tmp_path / "revoked.txt"
    server = coordinator_factory(pki.server_credentials(),
                                 Admission(revocations=RevocationList(revoked), require_certificate=True),
                                 min_available=9)
    carol = raw_agents(server.address, pki.agent_credentials("carol"))
    carol.join("carol")
    serial = load_certificate(pki.paths.agent_cert("carol")).serial_number
    append_revocation(revoked, serial=serial)
    err = _rpc_error(carol.heartbeat)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and f"serial {serial:x}" in err.details()
    assert carol.auth is not None and server.coordinator.registry.live_ids() == []


def test_a_real_agent_stops_with_a_clear_error_once_revoked(pki, coordinator_factory, tmp_path):
    revoked = tmp_path / "revoked.txt"
    append_revocation(revoked, agent_id="alice")
    server = coordinator_factory(pki.server_credentials(),
                                 Admission(revocations=RevocationList(revoked), require_certificate=True),
                                 min_available=9)
    model = MLP(in_features=4, hidden=(8,), num_classes=3)
    agent = Agent(AgentConfig(server=server.address, agent_id="alice", give_up_after=10.0,
                              credentials=pki.agent_credentials("alice")), LocalTrainer(model, _local_data(0)))
    with pytest.raises(FatalAgentError, match="PERMISSION_DENIED.*'alice' was revoked"):
        agent.run()


def test_enrollment_tokens_without_a_ca_say_nothing_of_an_unused_ca(pki, tmp_path, caplog):
    """tls.md's server-only form, --tls-cert/--tls-key with --enrollment-tokens, gives no CA: the line that a CA
    beside tokens goes unused is not said (QA: it was, naming a CA nobody gave)."""
    from fedpar.cli.run_settings import serve_parser
    from fedpar.cli.tlsopts import server_security

    tokens_file = tmp_path / "tokens.txt"
    mint_token(tokens_file, "dave")
    args = serve_parser().parse_args(["--tls-cert", str(pki.paths.server_cert), "--tls-key",
                                      str(pki.paths.server_key), "--enrollment-tokens", str(tokens_file)])
    security = server_security(args)
    assert security.description == "server TLS + enrollment tokens"
    assert not [r for r in caplog.records if "is not used" in r.getMessage()], caplog.text


def test_enrollment_tokens_beside_certs_admit_token_agents_on_server_only_tls(pki, coordinator_factory, raw_agents,
                                                                              tmp_path, caplog):
    """serve --certs DIR --enrollment-tokens FILE (serve --state needs the CA for its control port): the agents' port
    asks for no client certificate, so an agent with only the CA and its token joins (QA: it was refused for want
    of a certificate, the tokens unused); its agents are told to dial with the CA and a token."""
    from fedpar.cli.run_settings import serve_parser
    from fedpar.cli.tlsopts import server_security

    tokens_file = tmp_path / "tokens.txt"
    erin_token = mint_token(tokens_file, "erin")
    args = serve_parser().parse_args(["--certs", str(pki.ours), "--enrollment-tokens", str(tokens_file)])
    security = server_security(args)
    said = [r.getMessage() for r in caplog.records if "--enrollment-tokens" in r.getMessage()]
    assert said == ["--enrollment-tokens: agents are admitted by token, so the agents' port asks for no client "
                    "certificate and the CA of --certs/--tls-ca is not used (agents with certificates only need a "
                    "token too)"], said  # one-shot serve: a service (--state) needs the CA for its control port
    assert security.description == "server TLS + enrollment tokens"
    assert security.client_hint == f"--tls-ca {pki.ours / 'ca.pem'} --enrollment-token-file F"
    assert security.files.ca == pki.ours / "ca.pem"  # kept for the ranks' control channel
    server = coordinator_factory(security.credentials, security.admission, min_available=9)
    agent = raw_agents(server.address, channel_credentials(TlsFiles(None, None, pki.paths.ca_cert)))
    err = _rpc_error(lambda: agent.join("erin", token="not-the-token"))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "wrong enrollment token" in err.details()
    agent.join("erin", token=erin_token)
    assert server.coordinator.registry.get("erin") is not None
