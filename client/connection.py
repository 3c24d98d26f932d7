"""A client runtime's one connection to its coordinator: the settings that say how to reach it, the control
channel, one kept channel per aggregator rank a task names, and what TLS has to do with a failure to reach it."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

from fedpar.client.reconnect import FatalAgentError
from fedpar.client.deadline import UPLOAD_MARGIN_SECONDS
from fedpar.client.transfer import ingest_address
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.messages import DEFAULT_CHUNK_BYTES, channel_options
from fedpar.protocol.stubs import CoordinatorStub
from fedpar.security.handshake import diagnose_handshake, tls_mismatch
from fedpar.security.tls import TlsFiles


@dataclass
class AgentConfig:
    """How a client runtime reaches its coordinator and paces itself (``agent_id``: its identity there: a deployed
    agent's own id, or a simulation host's)."""

    server: str
    agent_id: str
    poll_seconds: float = 5.0  # long-poll wait per pull
    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    give_up_after: float | None = None  # seconds without reaching the coordinator; None: never
    upload_margin_seconds: float = UPLOAD_MARGIN_SECONDS  # kept free before the deadline beyond the upload estimate
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    credentials: grpc.ChannelCredentials | None = None  # TLS (mTLS with a client certificate) for every channel
    insecure: bool = False  # a plaintext channel instead: only asked for explicitly (loopback, tests)
    tls_server_name: str | None = None  # name to check the coordinator's certificate for, if not the host
    enrollment_token: str = ""  # for coordinators that admit agents without certificates by token
    drop_probability: float = 0.0  # simulations: chance of vanishing for a round
    seed: int | None = None  # drop decisions and backoff jitter; None: fresh entropy (agents must not move in lockstep)
    data_plane: bool = True  # move weights over the coordinator's data plane when a task offers it
    data_tls: ssl.SSLContext | None = None  # TLS for the data plane; without it a TLS agent keeps to gRPC
    tls_files: TlsFiles | None = None  # the PEM files behind ``credentials``: to say why a handshake fails

    def __post_init__(self) -> None:
        """ValueError unless the channel's security is said: credentials for TLS, or insecure=True for plaintext."""
        if self.credentials is None and not self.insecure:
            raise ValueError("AgentConfig has no credentials: pass credentials=... (grpc.ssl_channel_credentials) for "
                             "TLS, or insecure=True for a plaintext channel (loopback and tests only)")
        if self.credentials is not None and self.insecure:
            raise ValueError("AgentConfig: credentials and insecure=True contradict each other; drop one")


class Connection:
    """The channel to ``config.server`` and, opened on first use and kept, one to each aggregator rank."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.channel = self._open(config.server)
        self.stub = CoordinatorStub(self.channel)
        self._ingest: dict[str, tuple[grpc.Channel, CoordinatorStub]] = {}  # aggregator ranks' channels by address

    def _open(self, address: str) -> grpc.Channel:
        options = channel_options(64 << 20)
        if self.config.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.config.tls_server_name))
        if self.config.credentials is not None:
            return grpc.secure_channel(address, self.config.credentials, options=options)
        return grpc.insecure_channel(address, options=options)

    def ingest_stub(self, task: pb.TrainTask) -> CoordinatorStub:
        """The stub for the task's download and upload (one channel per aggregator rank, kept open)."""
        address = ingest_address(self.config.server, task)
        if address == self.config.server:
            return self.stub
        if address not in self._ingest:
            channel = self._open(address)
            self._ingest[address] = (channel, CoordinatorStub(channel))
        return self._ingest[address][1]

    def check_tls(self) -> str | None:
        """What TLS has to do with an unreachable coordinator (gRPC says only UNAVAILABLE): a TLS setting that
        differs from ours is returned, to be said in each retry line (its operator may restart it with ours); a
        wrong CA, a name mismatch or a refused certificate, which retrying does not cure, is a FatalAgentError."""
        mismatch = tls_mismatch(self.config.server, self.config.credentials is None)
        if mismatch is not None or self.config.credentials is None or self.config.tls_files is None:
            return mismatch
        problem = diagnose_handshake(self.config.server, self.config.tls_files, self.config.tls_server_name)
        if problem is not None:
            raise FatalAgentError(f"{self.config.agent_id}: {problem}")
        return None

    def close(self) -> None:
        """Close every channel."""
        self.channel.close()
        for channel, _ in self._ingest.values():
            channel.close()
