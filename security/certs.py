"""A small certificate authority for one federation: CA, server certificate, one client certificate per agent.

Keys are EC P-256 (fast to make, accepted by gRPC's TLS). The layout of a certificate folder is fixed so that
``--certs DIR`` is enough on every command: ca.pem/ca.key, server.pem/server.key, AGENT.pem/AGENT.key,
revoked.txt and tokens.txt.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedpar.protocol.atomicfile import atomic_write_bytes

DEFAULT_SERVER_NAMES = ("localhost", "127.0.0.1")
DEFAULT_DAYS = 365
OPERATOR_ROLE = "operator"  # subject OU of a certificate the control API answers (fedpar certs --operators)
# Agent ids that go into certificates are also file names: keep them to a safe alphabet (CN max is 64).
AGENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RESERVED_NAMES = {"ca", "server"}

PrivateKey = ec.EllipticCurvePrivateKey


def check_agent_id(agent_id: str, what: str = "agent id") -> str:
    """``agent_id`` if it can name a certificate and its files, else ValueError saying what is allowed (``what``:
    what the name is, e.g. "operator name")."""
    if not AGENT_ID_RE.fullmatch(agent_id or "") or agent_id in RESERVED_NAMES:
        raise ValueError(f"{what} {agent_id!r} cannot be used in a certificate: use 1-64 characters from "
                         "A-Z a-z 0-9 . _ - starting with a letter or digit (and not 'ca' or 'server')")
    return agent_id


@dataclass(frozen=True)
class CertPaths:
    """Where each file of a certificate folder lives."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        """The CA certificate that signs every other one."""
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        """The CA private key (only `fedpar certs` reads it)."""
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        """The coordinator's certificate."""
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        """The coordinator's private key."""
        return self.root / "server.key"

    @property
    def revoked(self) -> Path:
        """The revocation list the coordinator watches (what `fedpar certs --revoke` appends to)."""
        return self.root / "revoked.txt"

    @property
    def tokens(self) -> Path:
        """The SHA-256 of each enrollment token `fedpar certs` issued (what --enrollment-tokens reads)."""
        return self.root / "tokens.txt"

    def operator_cert(self, name: str) -> Path:
        """Client certificate of operator ``name`` (the control API's users)."""
        return self.root / "operators" / f"{check_agent_id(name, 'operator name')}.pem"

    def operator_key(self, name: str) -> Path:
        """Private key of operator ``name``."""
        return self.root / "operators" / f"{check_agent_id(name, 'operator name')}.key"

    def agent_cert(self, agent_id: str) -> Path:
        """Client certificate of ``agent_id``."""
        return self.root / f"{check_agent_id(agent_id)}.pem"

    def agent_key(self, agent_id: str) -> Path:
        """Private key of ``agent_id``."""
        return self.root / f"{check_agent_id(agent_id)}.key"


def new_private_key() -> PrivateKey:
    """A fresh EC P-256 private key."""
    return ec.generate_private_key(ec.SECP256R1())


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate small clock skew
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def create_ca(common_name: str = "fedpar CA", days: int = 10 * DEFAULT_DAYS) -> tuple[PrivateKey, x509.Certificate]:
    """A self-signed CA that may sign end-entity certificates only (path length 0)."""
    key = new_private_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpar")])
    cert = (_builder(name, name, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key: PrivateKey, ca_cert: x509.Certificate, common_name: str, usage: x509.ObjectIdentifier,
          days: int, san: x509.SubjectAlternativeName | None = None,
          role: str | None = None) -> tuple[PrivateKey, x509.Certificate]:
    key = new_private_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
                        + ([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)] if role else []))
    builder = (_builder(subject, ca_cert.subject, key.public_key(), days)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_agreement=True,
                                            content_commitment=False, data_encipherment=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False),
                              critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def server_san(names: Iterable[str]) -> x509.SubjectAlternativeName:
    """Subject alternative names: IP addresses as IPs, everything else as DNS names."""
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.-]{0,252})", name):
                raise ValueError(f"server name {name!r} is neither an IP address nor a DNS name; give each name the "
                                 "agents dial as its own --server-name, e.g. --server-name fl.example.org "
                                 "--server-name 10.0.0.5") from None
            entries.append(x509.DNSName(name))
    if not entries:
        raise ValueError("the server certificate needs at least one --server-name")
    if all(len(str(entry.value)) > 64 for entry in entries):  # its subject CN, which its ranks dial it by
        raise ValueError("the server certificate needs one --server-name of 64 characters at most (its subject "
                         "name); add one, e.g. the coordinator's IP address: --server-name 10.0.0.5")
    return x509.SubjectAlternativeName(entries)


def issue_server_cert(ca_key: PrivateKey, ca_cert: x509.Certificate, names: Iterable[str] = DEFAULT_SERVER_NAMES,
                      days: int = DEFAULT_DAYS) -> tuple[PrivateKey, x509.Certificate]:
    """The coordinator's certificate, valid for ``names`` (DNS names and IP addresses)."""
    names = list(names)
    san = server_san(names)
    subject = next(name for name in names if len(name) <= 64)  # a CN's most; server_san saw that one fits
    return _leaf(ca_key, ca_cert, subject, ExtendedKeyUsageOID.SERVER_AUTH, days, san)


def issue_agent_cert(ca_key: PrivateKey, ca_cert: x509.Certificate, agent_id: str,
                     days: int = DEFAULT_DAYS) -> tuple[PrivateKey, x509.Certificate]:
    """A client certificate whose subject common name is ``agent_id``: what the coordinator trusts as identity."""
    return _leaf(ca_key, ca_cert, check_agent_id(agent_id), ExtendedKeyUsageOID.CLIENT_AUTH, days)


def issue_operator_cert(ca_key: PrivateKey, ca_cert: x509.Certificate, name: str,
                        days: int = DEFAULT_DAYS) -> tuple[PrivateKey, x509.Certificate]:
    """A client certificate with the operator role (subject OU): the control API answers only these."""
    return _leaf(ca_key, ca_cert, check_agent_id(name, "operator name"), ExtendedKeyUsageOID.CLIENT_AUTH, days,
                 role=OPERATOR_ROLE)


def certificate_role(pem: bytes) -> str:
    """The role a PEM certificate was issued with: 'operator' or 'agent' (no role)."""
    cert = x509.load_pem_x509_certificate(pem)
    units = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    return OPERATOR_ROLE if OPERATOR_ROLE in units else "agent"


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, [data], mode=mode)


def write_private_key(path: Path, key: PrivateKey) -> None:
    """Write ``key`` as unencrypted PKCS#8 PEM, readable by the owner only (mode 0600)."""
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    _write_atomic(Path(path), data, 0o600)


def write_certificate(path: Path, cert: x509.Certificate) -> None:
    """Write ``cert`` as PEM (mode 0644: certificates are public)."""
    _write_atomic(Path(path), cert.public_bytes(serialization.Encoding.PEM), 0o644)


def load_certificate(path: Path) -> x509.Certificate:
    """A PEM certificate from ``path``."""
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


def key_matches(key, cert: x509.Certificate) -> bool:
    """Whether the private ``key`` is the key of ``cert`` (their public keys are one)."""
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key.public_key().public_bytes(*spki) == cert.public_key().public_bytes(*spki)


def load_ca(paths: CertPaths) -> tuple[PrivateKey, x509.Certificate]:
    """The CA key and certificate of a certificate folder; ValueError unless the key is the certificate's."""
    restore = f"restore the ca.pem and ca.key 'fedpar certs' made together in {paths.root}, or use a new --out"
    try:
        key = serialization.load_pem_private_key(paths.ca_key.read_bytes(), password=None)
    except (ValueError, TypeError):  # TypeError: a key encrypted with a password, which fedpar never asks for
        raise ValueError(f"{paths.ca_key} is not an unencrypted PEM private key; {restore}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{paths.ca_key} is not an EC private key made by 'fedpar certs'")
    try:
        cert = load_certificate(paths.ca_cert)
    except ValueError:  # cryptography's 'Unable to load PEM file. See https://... MalformedFraming'
        raise ValueError(f"{paths.ca_cert} is not a PEM certificate; {restore}") from None
    if not key_matches(key, cert):  # what it signed would be refused by every peer that checks against ca.pem
        raise ValueError(f"{paths.ca_key} is not the private key of {paths.ca_cert}, so no peer would accept what it "
                         f"signs; {restore}")
    return key, cert


def check_ca_dates(ca_cert: x509.Certificate, path: Path) -> None:
    """ValueError unless the CA is valid now: what it issued would be refused by every peer."""
    now = dt.datetime.now(dt.timezone.utc)
    if ca_cert.not_valid_after_utc < now:
        raise ValueError(f"the CA certificate {path} expired on {ca_cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, so "
                         "no certificate it issues is accepted; make a new folder with 'fedpar certs --out NEW_DIR "
                         "--agents ...' and give it to the coordinator and every agent")


def check_ca_outlasts(ca_cert: x509.Certificate, days: int, path: Path) -> None:
    """ValueError when certificates valid for ``days`` from now would outlive the CA at ``path``."""
    left = (ca_cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc)).days
    if days > left:  # each peer refuses what a CA issued once the CA has expired, whatever the certificate says
        fewer = f"give --days {left} or fewer, or " if left >= 1 else ""
        raise ValueError(f"--days {days} is longer than the CA certificate {path} is valid (until "
                         f"{ca_cert.not_valid_after_utc:%Y-%m-%d}), and peers refuse what it issued once it expires; "
                         f"{fewer}make a new folder with 'fedpar certs --out NEW_DIR --agents ...'")


def common_name(cert: x509.Certificate) -> str:
    """The subject common name of ``cert`` ('' if it has none)."""
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


def temporary_cert_dir(agent_ids: Iterable[str], days: int = 1) -> tempfile.TemporaryDirectory:
    """A temporary folder with a fresh CA, a loopback server certificate and one certificate per agent
    (simulations); call ``.cleanup()`` to delete the keys."""
    certs = tempfile.TemporaryDirectory(prefix="fedpar-certs-")
    ensure_certs(Path(certs.name), agent_ids, days=days)
    return certs


@dataclass
class CertReport:
    """What :func:`ensure_certs` did."""

    created_ca: bool
    written: list[Path]
    skipped: list[Path]


def ensure_certs(out: Path, agents: Iterable[str] = (), server_names: Iterable[str] | None = None,
                 days: int = DEFAULT_DAYS, force: bool = False, operators: Iterable[str] = ()) -> CertReport:
    """Make (or extend) a certificate folder: the CA if missing, the server certificate if missing or if
    ``server_names`` is given, one certificate per agent and one per operator (existing ones kept unless
    ``force``, which leaves the server certificate as it is)."""
    paths = CertPaths(Path(out))
    agents = [check_agent_id(a) for a in agents]
    if days < 1:
        raise ValueError("--days must be >= 1")
    written: list[Path] = []
    skipped: list[Path] = []
    created_ca = False
    if paths.ca_cert.exists() and paths.ca_key.exists():
        ca_key, ca_cert = load_ca(paths)
        check_ca_dates(ca_cert, paths.ca_cert)
    elif paths.ca_cert.exists() or paths.ca_key.exists():
        raise ValueError(f"{paths.root} holds only one of ca.pem and ca.key; restore the other or use a new --out")
    elif orphans := sorted(p.name for p in [*paths.root.glob("*.pem"), *paths.root.glob("operators/*.pem")]):
        # a new CA beside them would be kept alongside certificates no peer of it accepts
        raise ValueError(f"{paths.root} holds certificates ({', '.join(orphans[:3])}{', ...' if orphans[3:] else ''}) "
                         "but no ca.pem and ca.key: restore the CA that issued them, or use a new --out")
    else:
        ca_key, ca_cert = create_ca(days=max(days, 10 * DEFAULT_DAYS))
        write_private_key(paths.ca_key, ca_key)
        write_certificate(paths.ca_cert, ca_cert)
        written += [paths.ca_cert, paths.ca_key]
        created_ca = True
    server_due = server_names is not None or not paths.server_cert.exists()  # not --force: it would drop its names
    # agents and operators: one client certificate each, kept unless --force
    wanted = [(paths.agent_cert(a), paths.agent_key(a), issue_agent_cert, a) for a in agents] + \
        [(paths.operator_cert(n), paths.operator_key(n), issue_operator_cert, n) for n in operators]
    if server_due or any(force or not cert_path.exists() for cert_path, *_ in wanted):
        check_ca_outlasts(ca_cert, days, paths.ca_cert)
    if server_due:
        key, cert = issue_server_cert(ca_key, ca_cert, list(server_names or DEFAULT_SERVER_NAMES), days)
        write_private_key(paths.server_key, key)
        write_certificate(paths.server_cert, cert)
        written += [paths.server_cert, paths.server_key]
    for cert_path, key_path, issue, name in wanted:
        if cert_path.exists() and not force:
            skipped.append(cert_path)
            continue
        key, cert = issue(ca_key, ca_cert, name, days)
        write_private_key(key_path, key)
        write_certificate(cert_path, cert)
        written += [cert_path, key_path]
    return CertReport(created_ca, written, skipped)
