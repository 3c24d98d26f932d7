"""Which agents the coordinator admits: certificate identity, an optional allow-list, enrollment tokens,
and a revocation list that is re-read whenever its file changes.

Files (one entry per line, ``#`` starts a comment):
- tokens file: ``AGENT_ID SHA256_HEX_OF_TOKEN`` (the token itself is never stored);
- revocation file: an agent id, or ``serial:HEX`` for one certificate.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Iterable

import grpc

from fedpar.security.identity import PeerIdentity

log = logging.getLogger("fedpar.security")
MAX_TOKEN_CHARS = 512


class AdmissionRefused(Exception):
    """An agent the coordinator does not admit; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def hash_token(token: str) -> str:
    """Hex SHA-256 of an enrollment token (what the tokens file stores)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _entries(text: str):
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            yield number, line


def parse_token_hashes(text: str, source: str = "tokens file") -> dict[str, str]:
    """``{agent_id: sha256 hex}`` from a tokens file's text; ValueError naming the bad line."""
    out: dict[str, str] = {}
    for number, line in _entries(text):
        parts = line.split()
        digest = parts[1].lower().removeprefix("sha256:") if len(parts) == 2 else ""
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{source} line {number}: expected 'AGENT_ID SHA256_HEX', got {line!r}")
        out[parts[0]] = digest
    return out


def load_token_hashes(path: str | Path) -> dict[str, str]:
    """Read an enrollment tokens file (see :func:`parse_token_hashes`)."""
    path = Path(path)
    try:
        return parse_token_hashes(path.read_text(), str(path))
    except FileNotFoundError:
        raise ValueError(f"enrollment tokens file {path} does not exist; make one with "
                         "'fedpar certs --out DIR --mint-token AGENT'") from None


def mint_token(path: str | Path, agent_id: str) -> str:
    """A new random enrollment token for ``agent_id``; its hash is appended to ``path`` (mode 0600)."""
    token = secrets.token_urlsafe(32)
    _append_line(Path(path), f"{agent_id} {hash_token(token)}")
    return token


def _append_line(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def append_revocation(path: str | Path, agent_id: str | None = None, serial: int | None = None) -> None:
    """Add an agent id and/or a certificate serial to the revocation file (created if missing)."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if agent_id:
        _append_line(Path(path), f"{agent_id}  # revoked {stamp}")
    if serial is not None:
        _append_line(Path(path), f"serial:{serial:x}  # revoked {stamp}")


def parse_revocations(text: str, source: str = "revocation file") -> tuple[set[str], set[int]]:
    """Revoked agent ids and certificate serials; malformed serial lines are logged and skipped."""
    ids: set[str] = set()
    serials: set[int] = set()
    for number, line in _entries(text):
        if line.lower().startswith("serial:"):
            try:
                serials.add(int(line[7:].strip().replace(":", ""), 16))
            except ValueError:
                log.error("%s line %d: %r is not a hex serial number; line ignored", source, number, line)
        else:
            ids.add(line.split()[0])
    return ids, serials


class RevocationList:
    """Revoked agent ids and serials from a file that operators append to; re-read when it changes.

    A missing file means nothing is revoked (yet): it may be created while the coordinator runs.
    """

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self.ids: set[str] = set()
        self.serials: set[int] = set()
        self._signature: tuple | None = None
        self._lock = threading.Lock()
        self.refresh()

    def refresh(self) -> None:
        """Re-read the file if its size, mtime or inode changed since the last read."""
        if self.path is None:
            return
        try:
            st = self.path.stat()
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            signature = None
        with self._lock:
            if signature == self._signature:
                return
            text = self.path.read_text() if signature is not None else ""
            self.ids, self.serials = parse_revocations(text, str(self.path))
            self._signature = signature
        if signature is not None:
            log.info("revocation list %s: %d agent ids, %d certificate serials", self.path, len(self.ids),
                     len(self.serials))

    def is_revoked(self, agent_id: str, serial: int | None = None) -> bool:
        """Whether the agent id or the certificate serial is listed (call :meth:`refresh` first)."""
        return agent_id in self.ids or (serial is not None and serial in self.serials)


class Admission:
    """Decides who may join and who may keep calling. With no options it admits anyone (plaintext tests)."""

    def __init__(self, allowed_ids: Iterable[str] | None = None, token_hashes: dict[str, str] | None = None,
                 revocations: RevocationList | None = None, require_certificate: bool = False):
        self.allowed_ids = set(allowed_ids) if allowed_ids is not None else None
        self.token_hashes = token_hashes
        self.revocations = revocations or RevocationList(None)
        self.require_certificate = require_certificate

    def admit_join(self, agent_id: str, peer: PeerIdentity | None, enrollment_token: str = "") -> None:
        """Raise AdmissionRefused unless ``agent_id`` may join over a connection proving ``peer``."""
        self.check_call(agent_id, peer)
        if self.allowed_ids is not None and agent_id not in self.allowed_ids:
            raise AdmissionRefused(grpc.StatusCode.PERMISSION_DENIED,
                                   f"agent {agent_id!r} is not on this coordinator's allow-list; "
                                   "ask its operator to add it (--allow-agents)")
        if peer is None and self.token_hashes is not None:
            expected = self.token_hashes.get(agent_id, "")
            given = hash_token(enrollment_token[:MAX_TOKEN_CHARS]) if enrollment_token else "-"
            if not hmac.compare_digest(expected.encode(), given.encode()) or not expected:
                what = "wrong" if enrollment_token else "missing"
                raise AdmissionRefused(grpc.StatusCode.UNAUTHENTICATED,
                                       f"{what} enrollment token for agent {agent_id!r}; ask the operator for "
                                       "one ('fedpar certs --mint-token') and pass it with --enrollment-token-file")

    def check_call(self, agent_id: str, peer: PeerIdentity | None) -> None:
        """Raise AdmissionRefused if the certificate names someone else, or the agent was revoked."""
        if peer is None and self.require_certificate:
            raise AdmissionRefused(grpc.StatusCode.UNAUTHENTICATED,
                                   "this coordinator requires a client certificate signed by its CA")
        if peer is not None and peer.common_name != agent_id:
            raise AdmissionRefused(grpc.StatusCode.PERMISSION_DENIED,
                                   f"the client certificate proves agent {peer.common_name!r}, but the request "
                                   f"names agent {agent_id!r}; use --agent-id {peer.common_name} or that "
                                   "agent's own certificate")
        self.revocations.refresh()
        serial = peer.serial if peer is not None else None
        if self.revocations.is_revoked(agent_id, serial):
            what = f"agent {agent_id!r}" if agent_id in self.revocations.ids else \
                f"the certificate (serial {serial:x}) of agent {agent_id!r}"
            raise AdmissionRefused(grpc.StatusCode.PERMISSION_DENIED,
                                   f"{what} was revoked by the coordinator's operator; it may not take part any "
                                   "more (ask for a new certificate if this is a mistake)")

    def revoked_filter(self):
        """A predicate ``(agent_id, serial) -> revoked?`` on the current revocation list (read once)."""
        self.revocations.refresh()
        return self.revocations.is_revoked
