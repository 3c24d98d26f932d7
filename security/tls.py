"""gRPC TLS credentials for the coordinator and its agents, built from PEM files (checked at start-up)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedpar.security.certs import CertPaths, common_name

HOW_TO_FIX = ("make certificates with 'fedpar certs --out certs --agents ID1,ID2' and pass '--certs certs', "
              "or pass '--insecure' for plaintext gRPC (only on a network you trust)")


class TlsSetupError(ValueError):
    """TLS cannot be set up from the given options; the message says what to do."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one endpoint: its certificate and key (optional on a client) and the CA it trusts."""

    cert: Path | None
    key: Path | None
    ca: Path | None

    @property
    def mutual(self) -> bool:
        """Whether the endpoint presents a certificate and verifies the peer's against ``ca``."""
        return self.cert is not None and self.ca is not None


def _pick(explicit: str | Path | None, from_dir: Path | None) -> Path | None:
    return Path(explicit) if explicit else from_dir


def server_tls_files(certs_dir: str | Path | None = None, cert: str | Path | None = None,
                     key: str | Path | None = None, ca: str | Path | None = None) -> TlsFiles:
    """The coordinator's files: DIR/server.pem, DIR/server.key, DIR/ca.pem, each overridable."""
    paths = CertPaths(Path(certs_dir)) if certs_dir else None
    files = TlsFiles(_pick(cert, paths and paths.server_cert), _pick(key, paths and paths.server_key),
                     _pick(ca, paths and paths.ca_cert))
    if files.cert is None or files.key is None:
        raise TlsSetupError(f"no server certificate and key given; {HOW_TO_FIX}")
    return files


def client_tls_files(agent_id: str, certs_dir: str | Path | None = None, cert: str | Path | None = None,
                     key: str | Path | None = None, ca: str | Path | None = None) -> TlsFiles:
    """An agent's files: DIR/AGENT.pem, DIR/AGENT.key, DIR/ca.pem, each overridable."""
    paths = CertPaths(Path(certs_dir)) if certs_dir else None
    files = TlsFiles(_pick(cert, paths and paths.agent_cert(agent_id)),
                     _pick(key, paths and paths.agent_key(agent_id)), _pick(ca, paths and paths.ca_cert))
    if files.ca is None:
        raise TlsSetupError(f"no CA certificate given to check the coordinator with; {HOW_TO_FIX}")
    if (files.cert is None) != (files.key is None):
        raise TlsSetupError("--tls-cert and --tls-key go together")
    return files


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsSetupError(f"{what} {path} does not exist; {HOW_TO_FIX}") from None
    except OSError as exc:
        raise TlsSetupError(f"cannot read {what} {path}: {exc.strerror}") from None


def load_pair(files: TlsFiles) -> tuple[bytes, bytes]:
    """The certificate and key PEM of ``files``, checked (readable, PEM, the key matches the certificate); a
    TlsSetupError saying which file is wrong."""
    cert_pem, key_pem = _read(files.cert, "certificate"), _read(files.key, "private key")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise TlsSetupError(f"{files.cert} is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise TlsSetupError(f"{files.key} is not an unencrypted PEM private key") from None
    if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
            != cert.public_key().public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo):
        raise TlsSetupError(f"{files.key} is not the private key of {files.cert}")
    return cert_pem, key_pem


def load_ca(path: Path) -> bytes:
    """The CA certificate PEM at ``path``, checked; a TlsSetupError saying what is wrong."""
    pem = _read(path, "CA certificate")
    try:
        x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise TlsSetupError(f"{path} is not a PEM CA certificate") from None
    return pem


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server TLS; with a CA, mutual TLS that refuses any client without a certificate signed by it."""
    cert_pem, key_pem = load_pair(files)
    ca_pem = load_ca(files.ca) if files.ca is not None else None
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca_pem,
                                       require_client_auth=ca_pem is not None)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client TLS that checks the coordinator against ``files.ca`` and presents the agent's certificate."""
    ca_pem = load_ca(files.ca)
    if files.cert is None:
        return grpc.ssl_channel_credentials(root_certificates=ca_pem)
    cert_pem, key_pem = load_pair(files)
    return grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem)


def certificate_common_name(path: Path) -> str:
    """Subject CN of the certificate at ``path`` (to check an agent's --agent-id against its certificate)."""
    return common_name(x509.load_pem_x509_certificate(_read(Path(path), "certificate")))
