"""A health probe of a coordinator behind mutual TLS, as docs/how-to/metrics.md tells operators to set it up: it
completes the handshake only with a client certificate of the coordinator's CA (one of its own, 'fedpar certs
--agents probe'), needs no session, and is refused with an operator's certificate or once its own is revoked."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedpar.security.admission import Admission, RevocationList, append_revocation
from fedpar.security.certs import ensure_certs
from fedpar.security.tls import TlsFiles, channel_credentials, client_tls_files


def _check(address: str, credentials: grpc.ChannelCredentials) -> int:
    """One grpc.health.v1 Check of the whole server."""
    with grpc.secure_channel(address, credentials) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_probe_needs_a_certificate_of_the_coordinators_ca_and_no_session(pki, coordinator_factory):
    ensure_certs(pki.ours, ["probe"], operators=["ops"])
    revoked = pki.ours / "probe-revoked.txt"
    admission = Admission(revocations=RevocationList(revoked), require_certificate=True)
    server = coordinator_factory(pki.server_credentials(), admission=admission, min_available=5)
    probe = channel_credentials(client_tls_files("probe", pki.ours))
    assert _check(server.address, probe) in (health_pb2.HealthCheckResponse.SERVING,
                                             health_pb2.HealthCheckResponse.NOT_SERVING)
    ca_only = grpc.ssl_channel_credentials((pki.ours / "ca.pem").read_bytes())
    with pytest.raises(grpc.RpcError) as refused:  # the TLS handshake itself: no certificate, no answer
        _check(server.address, ca_only)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    operator = channel_credentials(TlsFiles(pki.paths.operator_cert("ops"), pki.paths.operator_key("ops"),
                                            pki.paths.ca_cert))
    with pytest.raises(grpc.RpcError) as refused:  # the control API's certificate, not an agent's
        _check(server.address, operator)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    append_revocation(revoked, agent_id="probe")
    with pytest.raises(grpc.RpcError) as refused:
        _check(server.address, probe)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
