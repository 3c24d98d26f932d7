"""gRPC TLS credentials for the coordinator and its agents, built from PEM files (checked at start-up)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedpar.protocol.small_files import read_small_file
from fedpar.security.certs import OPERATOR_ROLE, CertPaths, common_name, key_matches

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
    if files.cert is None and files.key is None:
        raise TlsSetupError(f"no server certificate and key given; {HOW_TO_FIX}")
    if files.key is None:  # said as neither given
        raise TlsSetupError(f"--tls-cert {files.cert} needs its private key: add --tls-key KEY")
    if files.cert is None:
        raise TlsSetupError(f"--tls-key {files.key} needs its certificate: add --tls-cert PEM")
    return files


def client_tls_files(agent_id: str, certs_dir: str | Path | None = None, cert: str | Path | None = None,
                     key: str | Path | None = None, ca: str | Path | None = None) -> TlsFiles:
    """An agent's files: DIR/AGENT.pem, DIR/AGENT.key, DIR/ca.pem, each overridable."""
    paths = CertPaths(Path(certs_dir)) if certs_dir else None
    files = TlsFiles(_pick(cert, paths and paths.agent_cert(agent_id)),
                     _pick(key, paths and paths.agent_key(agent_id)), _pick(ca, paths and paths.ca_cert))
    if files.key is None and files.cert is not None:  # said before a missing CA: the pair is the half given
        raise TlsSetupError(f"--tls-cert {files.cert} needs its private key: add --tls-key KEY")
    if files.cert is None and files.key is not None:
        raise TlsSetupError(f"--tls-key {files.key} needs its certificate: add --tls-cert PEM")
    if files.ca is None and files.cert is not None:
        raise TlsSetupError("no CA certificate given to check the coordinator with: add --tls-ca CA.pem (the ca.pem "
                            "of the 'fedpar certs' folder that issued the certificates), or pass --certs DIR")
    if files.ca is None:
        raise TlsSetupError(f"no CA certificate given to check the coordinator with; {HOW_TO_FIX}")
    return files


def _read(path: Path, what: str) -> bytes:
    try:
        return read_small_file(path, what)
    except FileNotFoundError:
        raise TlsSetupError(f"{what} {path} does not exist; {HOW_TO_FIX}") from None
    except OSError as exc:
        raise TlsSetupError(f"cannot read {what} {path}: {exc.strerror}") from None
    except ValueError as exc:  # not a regular file (/dev/zero was read until memory ran out), or far too large
        raise TlsSetupError(f"{exc}; {HOW_TO_FIX}") from None


USAGES = {"server": ExtendedKeyUsageOID.SERVER_AUTH, "client": ExtendedKeyUsageOID.CLIENT_AUTH}
ENDPOINTS = {"server": "a coordinator", "client": "an agent or operator"}
REISSUE = {"server": "every agent would refuse it; re-issue it with 'fedpar certs --out DIR --server-name NAME' "
                     "(one per name agents dial)",
           "client": "the coordinator would refuse it; have a new one issued: 'fedpar certs --out DIR {flag} {name} "
                     "--force'"}


def _is_ca(cert: x509.Certificate) -> bool:
    """Whether ``cert`` may sign others (basic constraints, or a self-issued certificate without them)."""
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return cert.subject == cert.issuer


def _kind(cert: x509.Certificate) -> str:
    """What ``cert`` is, for messages: a CA's, the coordinator's or an agent's (or operator's)."""
    if _is_ca(cert):
        return "a CA certificate (ca.pem)"
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return f"the certificate of {common_name(cert)!r}"
    if ExtendedKeyUsageOID.SERVER_AUTH in usages:
        return f"a coordinator's certificate (server.pem, for {common_name(cert)!r})"
    return f"the client certificate of {common_name(cert)!r} (an agent's or operator's ID.pem)"


def _flag_of(cert: x509.Certificate) -> str:
    """The 'fedpar certs' option that issues a client certificate like ``cert``: --operators or --agents."""
    units = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    return "--operators" if OPERATOR_ROLE in units else "--agents"


def _reissue_pair(cert: x509.Certificate) -> str:
    """The 'fedpar certs' command that issues a new certificate and key in place of ``cert``'s."""
    try:
        server = ExtendedKeyUsageOID.SERVER_AUTH in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        server = False
    if server:
        return "'fedpar certs --out DIR --server-name NAME' (one per name agents dial)"
    return f"'fedpar certs --out DIR {_flag_of(cert)} {common_name(cert)} --force'"


def _valid_now(cert: x509.Certificate) -> bool:
    """Whether the clock of this machine is within ``cert``'s validity."""
    return cert.not_valid_before_utc <= dt.datetime.now(dt.timezone.utc) <= cert.not_valid_after_utc


def _when_invalid(cert: x509.Certificate) -> str:
    """Why ``cert`` is not valid now, for messages: 'expired on ...' or 'is valid only from ...'."""
    if dt.datetime.now(dt.timezone.utc) > cert.not_valid_after_utc:
        return f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    return f"is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (check this machine's clock)"


def check_leaf(cert: x509.Certificate, path: Path, usage: str | None) -> None:
    """TlsSetupError unless ``cert`` fits an endpoint of ``usage`` ("server", "client"; None: any): not a CA's,
    issued for that use and valid now (else the peer refuses it, which TLS tells neither side clearly)."""
    want = {"server": "the coordinator's certificate (server.pem of its 'fedpar certs' folder)",
            "client": "this agent's own certificate (ID.pem of its 'fedpar certs' folder)"}.get(usage)
    if _is_ca(cert):
        raise TlsSetupError(f"{path} is {_kind(cert)}, which signs certificates but is no endpoint's own; give "
                            f"{want or 'this endpoint its own certificate'}")
    if usage is None:
        return
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usages = [USAGES[usage]]  # a certificate without usages may serve either end
    if USAGES[usage] not in usages:
        raise TlsSetupError(f"{path} is {_kind(cert)}, not one for {ENDPOINTS[usage]}; give {want}")
    if not _valid_now(cert):
        reissue = REISSUE[usage].format(name=common_name(cert), flag=_flag_of(cert))
        raise TlsSetupError(f"{path} {_when_invalid(cert)}, so {reissue}")


def load_pair(files: TlsFiles, usage: str | None = None) -> tuple[bytes, bytes]:
    """The certificate and key PEM of ``files``, checked (readable, PEM, fit for ``usage``: see
    :func:`check_leaf`, the key matches the certificate); a TlsSetupError saying which file is wrong."""
    cert_pem = _read(files.cert, "certificate")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise TlsSetupError(f"{files.cert} is not a PEM certificate") from None
    check_leaf(cert, files.cert, usage)
    if files.key is not None and not files.key.exists():  # 'make certificates with fedpar certs' kept this one
        raise TlsSetupError(f"private key {files.key} does not exist beside its certificate {files.cert}; give the key "
                            f"made with it, or re-issue the pair: {_reissue_pair(cert)}")
    key_pem = _read(files.key, "private key")
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise TlsSetupError(f"{files.key} is not an unencrypted PEM private key") from None
    if not key_matches(key, cert):
        raise TlsSetupError(f"{files.key} is not the private key of {files.cert}; give the key made with it (one "
                            "lost: re-issue the pair, 'fedpar certs --out DIR --agents ID --force', or --server-name "
                            "NAME for the coordinator's)")
    return cert_pem, key_pem


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether ``ca`` issued ``cert`` (names match and the signature verifies)."""
    if cert.issuer != ca.subject:
        return False
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):  # a bad signature, or a key type it cannot check
        return False
    return True


def foreign_server_certificate(files: TlsFiles) -> bool:
    """Whether the coordinator's one certificate (no chain) was issued by none of the CAs it checks agents with:
    agents given that ca.pem to check it, as a 'fedpar certs' folder has them, would refuse it."""
    try:
        certs = x509.load_pem_x509_certificates(files.cert.read_bytes())
        cas = x509.load_pem_x509_certificates(files.ca.read_bytes())
    except (OSError, ValueError):  # said by the credentials that read them
        return False
    return len(certs) == 1 and not any(signed_by(certs[0], ca) for ca in cas)


def load_ca(path: Path) -> bytes:
    """The CA certificate PEM at ``path``, checked; a TlsSetupError saying what is wrong."""
    pem = _read(path, "CA certificate")
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise TlsSetupError(f"{path} is not a PEM CA certificate") from None
    for cert in certs:
        if not _is_ca(cert):  # said later as every peer's certificate being 'not signed by the CA'
            raise TlsSetupError(f"{path} is {_kind(cert)}, not a CA certificate; give the ca.pem of the 'fedpar "
                                "certs' folder that issued the certificates")
    if not any(_valid_now(cert) for cert in certs):  # every handshake would fail, each side blaming the other
        raise TlsSetupError(f"the CA certificate {path} {_when_invalid(certs[0])}, so no certificate it issued is "
                            "accepted; make a new folder with 'fedpar certs --out NEW_DIR --agents ...' and give it to "
                            "the coordinator and every agent")
    return pem


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server TLS; with a CA, mutual TLS that refuses any client without a certificate signed by it."""
    cert_pem, key_pem = load_pair(files, "server")
    ca_pem = load_ca(files.ca) if files.ca is not None else None
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca_pem,
                                       require_client_auth=ca_pem is not None)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client TLS that checks the coordinator against ``files.ca`` and presents the agent's certificate."""
    ca_pem = load_ca(files.ca)
    if files.cert is None:
        return grpc.ssl_channel_credentials(root_certificates=ca_pem)
    cert_pem, key_pem = load_pair(files, "client")
    return grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem)


def certificate_common_name(path: Path) -> str:
    """Subject CN of the certificate at ``path`` (to check an agent's --agent-id against its certificate)."""
    return common_name(x509.load_pem_x509_certificate(_read(Path(path), "certificate")))
