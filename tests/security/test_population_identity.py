"""A simulation host under mutual TLS: its certificate speaks for its members (who have none of their own), and
for nobody else; another certificate cannot use the host's or its members' sessions."""

from __future__ import annotations

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.security.admission import Admission, RevocationList, append_revocation
from fedpar.security.certs import load_certificate
from support.population_calls import join_members, member_auth, pull_tasks, refused


def test_a_hosts_certificate_speaks_for_its_members_and_no_other_certificate_does(pki, coordinator_factory,
                                                                                raw_agents, tmp_path):
    revoked = tmp_path / "revoked.txt"
    server = coordinator_factory(pki.server_credentials(), Admission(revocations=RevocationList(revoked),
                                                                      require_certificate=True),
                                 accept_populations=True, min_available=2, clients_per_round=2)
    host = raw_agents(server.address, pki.agent_credentials("alice")).stub  # alice's certificate: the host's
    other = raw_agents(server.address, pki.agent_credentials("bob")).stub
    # bob's certificate cannot register a population as alice
    refused(lambda: join_members(other, "alice", ["m1", "m2"]), grpc.StatusCode.PERMISSION_DENIED,
            "proves agent 'bob'")
    reply = join_members(host, "alice", ["m1", "m2"])
    m1 = member_auth(reply, "m1")
    # a member's calls go over its host's connection, with the member's own session
    assert host.Heartbeat(pb.HeartbeatRequest(auth=m1), timeout=10).current_round >= 0
    pulled = pull_tasks(host, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="alice", token=reply.host_token),
                                                        wait_seconds=5), timeout=15)
    assert sorted(t.agent_id for t in pulled.tasks) == ["m1", "m2"]  # both sampled, as the host's members
    # ... and not over another certificate's, even with the right tokens
    refused(lambda: other.Heartbeat(pb.HeartbeatRequest(auth=m1), timeout=10), grpc.StatusCode.PERMISSION_DENIED,
            "proves agent 'bob', but the request names agent 'alice'")
    refused(lambda: pull_tasks(other, pb.PullHostTasksRequest(
        host=pb.AgentAuth(agent_id="alice", token=reply.host_token), wait_seconds=0), timeout=10),
        grpc.StatusCode.PERMISSION_DENIED, "proves agent 'bob'")
    # revoking the host's certificate revokes its members' calls with it
    append_revocation(revoked, serial=load_certificate(pki.paths.agent_cert("alice")).serial_number)
    refused(lambda: host.Heartbeat(pb.HeartbeatRequest(auth=m1), timeout=10), grpc.StatusCode.PERMISSION_DENIED,
            "revoked")
