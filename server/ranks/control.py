"""The calls aggregator ranks make to rank 0 during a round: fedpar.proto's RankControl service ("count these
uploads", "this one was refused after all", "this agent has its weights", "I am alive"). Rank 0 alone decides which
uploads count (first K, deadline, duplicates); its answers are server/ranks/calls.py.

The service runs on rank 0, apart from the agents' port and bound where the process group's rendezvous is. Its
callers are the other ranks of the group, which already trust each other (they share the process group); each call
carries, in its metadata, the caller's rank and a secret that rank 0 broadcasts over the group at start-up. When the
coordinator has certificates (--certs, --tls-cert) the service speaks TLS with its certificate, which the callers
check against its CA; without, it is plaintext, said once at start-up when the ranks reach it from another host.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
import socket
from typing import Awaitable

import grpc
from google.protobuf.message import Message

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.security.tls import TlsFiles, certificate_common_name, load_ca, load_pair
from fedpar.server.ranks.messages import RankMessageError, decode, encode
from fedpar.server.rounds import Refusal

log = logging.getLogger("fedpar.server")
SERVICE = pb.DESCRIPTOR.services_by_name["RankControl"]
SECRET_HEADER = "x-fedpar-rank-secret"
RANK_HEADER = "x-fedpar-rank"
HEARTBEAT_SECONDS = 1.0  # how often the other ranks tell rank 0 they are alive
REQUESTS: dict[str, type[Message]] = {m.name: getattr(pb, m.input_type.name) for m in SERVICE.methods}
ACK = pb.RankAck().SerializeToString()


def new_secret() -> str:
    """A fresh secret for one run of the group."""
    return secrets.token_urlsafe(24)


def _identity(data: bytes) -> bytes:
    return data


def control_handler(secret: str, world: int, calls) -> grpc.GenericRpcHandler:
    """Rank 0's side of RankControl: each call's secret and rank are checked and its request decoded (a malformed
    one is refused with INVALID_ARGUMENT, naming the rank), then ``calls``' method of the call's name in lower case
    takes (rank, request); a Refusal it raises becomes the call's status and message."""

    def method(name: str, kind: type[Message]):
        answer = getattr(calls, name.lower())

        async def call(request: bytes, context):
            metadata = dict(context.invocation_metadata())
            if not hmac.compare_digest(metadata.get(SECRET_HEADER, "").encode(), secret.encode()):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not an aggregator rank of this coordinator")
            try:
                rank = caller_rank(metadata.get(RANK_HEADER, ""), world)
                reply = answer(rank, decode(kind, request, f"aggregator rank {rank}"))
                if isinstance(reply, Awaitable):
                    await reply
            except RankMessageError as exc:
                log.warning("RankControl.%s refused: %s", name, exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Refusal as r:
                await context.abort(r.code, r.message)
            return ACK
        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=_identity,
                                                   response_serializer=_identity)

    return grpc.method_handlers_generic_handler(SERVICE.full_name,
                                                {name: method(name, kind) for name, kind in REQUESTS.items()})


def add_control_port(server: grpc.aio.Server, host: str, tls: TlsFiles | None) -> int:
    """Bind rank 0's control service on ``host`` (a free port, returned): under TLS with the coordinator's certificate
    when ``tls`` (callers prove who they are with the secret, not a certificate), else plaintext, with one warning
    when ``host`` is not a loopback address."""
    if tls is not None:
        cert_pem, key_pem = load_pair(tls)
        return server.add_secure_port(f"{host}:0", grpc.ssl_server_credentials([(key_pem, cert_pem)]))
    warning = plaintext_warning(host)
    if warning:
        log.warning(warning)
    return server.add_insecure_port(f"{host}:0")


def plaintext_warning(host: str) -> str | None:
    """The line that says rank 0's control service on ``host`` is unencrypted, or None when only this machine can
    reach it (a loopback address)."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return None
    except (OSError, ValueError):
        pass
    return (f"aggregator ranks: rank 0's control channel on {host} is PLAINTEXT: its secret and every count travel "
            "unencrypted; give the coordinator certificates (--certs) when the ranks run on several hosts")


def caller_rank(header: str, world: int) -> int:
    """The rank a call's metadata names: one of 1..world-1 (RankMessageError otherwise)."""
    if not header.isdigit() or not 0 < int(header) < world:
        raise RankMessageError(f"a RankControl call named {header!r} as its aggregator rank, not one of 1.."
                               f"{world - 1}")
    return int(header)


class RankControlClient:
    """Rank ``rank``'s calls to rank 0 (on the rank's event loop); a refusal comes back as the same Refusal."""

    def __init__(self, target: str, secret: str, rank: int, timeout_seconds: float, tls: TlsFiles | None = None):
        if tls is None:
            self.channel = grpc.aio.insecure_channel(target)
        else:  # rank 0 answers with the coordinator's certificate, whatever address the group reaches it at
            credentials = grpc.ssl_channel_credentials(root_certificates=load_ca(tls.ca) if tls.ca else None)
            self.channel = grpc.aio.secure_channel(target, credentials, options=[
                ("grpc.ssl_target_name_override", certificate_common_name(tls.cert))])
        self.metadata = ((SECRET_HEADER, secret), (RANK_HEADER, str(rank)))
        self.timeout = timeout_seconds

    async def call(self, name: str, message: Message) -> None:
        """Call RankControl's ``name`` with ``message``; the Refusal rank 0 answered with, if it did."""
        if not isinstance(message, REQUESTS[name]):
            raise TypeError(f"RankControl.{name} takes a {REQUESTS[name].__name__}, not {type(message).__name__}")
        rpc = self.channel.unary_unary(f"/{SERVICE.full_name}/{name}", request_serializer=encode,
                                       response_deserializer=_identity)
        try:
            reply = await rpc(message, metadata=self.metadata, timeout=self.timeout)
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Refusal(grpc.StatusCode.UNAVAILABLE, "the coordinator's rank 0 did not answer; the update was "
                              "not applied: send it again") from None
            raise Refusal(err.code(), err.details() or err.code().name) from None
        except grpc.aio.UsageError:  # closed: this rank was told to stop while an agent's upload was on its way
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "this aggregator rank is stopping; the update was not applied: "
                          "send it again") from None
        decode(pb.RankAck, reply, "rank 0")

    async def close(self) -> None:
        """Close the channel."""
        await self.channel.close()
