"""Who is calling and whether the coordinator admits them: the certificate identity a call proves, an optional
allow-list, enrollment tokens, and a revocation list that is re-read whenever its file changes.

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
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Mapping, TypeVar

import grpc
from cryptography import x509

from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.small_files import NotASettingsFile, not_utf8, read_small_file
from fedpar.security.certs import certificate_role

log = logging.getLogger("fedpar.security")
MAX_TOKEN_CHARS = 512
T = TypeVar("T")


@dataclass(frozen=True)
class PeerIdentity:
    """An agent identity proven by a client certificate that the coordinator's CA signed."""

    common_name: str
    serial: int | None = None
    role: str = "agent"  # an operator's certificate (fedpar certs --operators) is for the control API only

    def describe(self) -> str:
        """Human-readable form for refusal messages."""
        serial = f", serial {self.serial:x}" if self.serial is not None else ""
        return f"certificate CN={self.common_name!r}{serial}"


@lru_cache(maxsize=4096)
def _facts_of(pem: bytes) -> tuple[int | None, str]:
    try:
        return x509.load_pem_x509_certificate(pem).serial_number, certificate_role(pem)
    except ValueError:
        return None, "agent"


def peer_identity(context) -> PeerIdentity | None:
    """The identity a call's TLS client certificate proves, or None (plaintext or server-only TLS).

    gRPC fills ``auth_context()`` only after it verified the certificate chain against the server's CA,
    so the CN found there can be trusted.
    """
    try:
        auth = context.auth_context()
    except (AttributeError, RuntimeError):
        return None
    names = auth.get("x509_common_name") or []
    if not names:
        return None
    pems = auth.get("x509_pem_cert") or []
    serial, role = _facts_of(bytes(pems[0])) if pems else (None, "agent")
    return PeerIdentity(bytes(names[0]).decode("utf-8", "replace"), serial, role)


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


def mint_token(path: str | Path, agent_id: str) -> str:
    """A new random enrollment token for ``agent_id``; its hash goes into ``path`` (mode 0600) in place of any earlier
    one of ``agent_id`` (:func:`has_token` says whether there was one), which then enrolls no more."""
    token = secrets.token_urlsafe(32)
    path = Path(path)
    line = f"{agent_id} {hash_token(token)}"
    if not has_token(path, agent_id):
        _append_line(path, line)
        return token
    kept = [raw for raw in path.read_text(encoding="utf-8-sig").splitlines() if _token_id(raw) != agent_id]
    # whole or not at all: a coordinator reading the file meanwhile sees the old token or the new one, never neither
    atomic_write_bytes(path, ["".join(f"{raw}\n" for raw in [*kept, line]).encode()], mode=0o600)
    return token


def has_token(path: str | Path, agent_id: str) -> bool:
    """Whether the tokens file ``path`` (missing: none) holds a token hash of ``agent_id``."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8-sig").splitlines() if path.is_file() else []  # -sig: as it is read
    return any(_token_id(raw) == agent_id for raw in lines)


def _token_id(raw: str) -> str | None:
    """The agent id a tokens file's line ``raw`` is for (None: a blank or comment line)."""
    fields = raw.split("#", 1)[0].split()
    return fields[0] if fields else None


def _append_line(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def append_revocation(path: str | Path, agent_id: str | None = None, serial: int | None = None) -> bool:
    """Add an agent id and/or a certificate serial to the revocation file (created if missing); False when each was
    revoked there already (nothing added: a second line would only have to be removed twice to undo it). ValueError
    'cannot use PATH: why' when the file cannot be read as a coordinator reads it."""
    path = Path(path)
    ids, serials = read_edited_file(path, parse_revocations) if path.is_file() else (set(), set())
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    added = False
    if agent_id and agent_id not in ids:
        _append_line(path, f"{agent_id}  # revoked {stamp}")
        added = True
    if serial is not None and serial not in serials:
        _append_line(path, f"serial:{serial:x}  # revoked {stamp}")
        added = True
    return added


def parse_revocations(text: str, source: str = "revocation file") -> tuple[set[str], set[int]]:
    """Revoked agent ids and certificate serials; malformed serial lines are logged and skipped. A line is one id; one
    naming several (``a3,a4``, as ``certs --revoke`` takes them, or ``a3 a4``) revokes each, with a warning: an
    id holds neither commas nor spaces, and a revocation that matched nobody would let them all in."""
    ids: set[str] = set()
    serials: set[int] = set()
    for number, line in _entries(text):
        if line.lower().startswith("serial:"):
            try:
                serials.add(int(line[7:].strip().replace(":", ""), 16))
            except ValueError:
                log.error("%s line %d: %r is not a hex serial number; line ignored", source, number, line)
            continue
        named = line.replace(",", " ").split()
        if len(named) > 1:
            log.warning("%s line %d names %d ids (%s); each is revoked: write one id a line", source, number,
                        len(named), ", ".join(named))
        ids.update(named)
    return ids, serials


def read_edited_file(path: Path, parse: Callable[[str, str], T]) -> T:
    """``parse`` of the text of ``path``, a file operators edit (revoked.txt, tokens.txt), as a coordinator reads
    it; ValueError 'cannot use PATH: why' when it cannot be read or parsed."""
    try:
        return parse(read_small_file(path, "").decode("utf-8-sig"), str(path))  # -sig: an editor's byte-order mark
    except OSError as exc:  # its strerror: not "[Errno 21] Is a directory: 'PATH'"
        raise ValueError(f"cannot use {path}: {exc.strerror or exc}") from None
    except NotASettingsFile as exc:  # /dev/zero was read until memory ran out
        raise ValueError(f"cannot use {path}: it {exc.reason}") from None
    except UnicodeDecodeError as exc:  # e.g. saved as UTF-16 by an editor
        raise ValueError(f"cannot use {path}: it {not_utf8(exc)}") from None
    except ValueError as exc:
        raise ValueError(f"cannot use {path}: {exc}") from None


class WatchedFile:
    """The parsed contents of a text file that operators edit while the coordinator runs.

    Re-parsed whenever the file's size, mtime or inode changes. A missing file parses as empty text. A file
    that cannot be read or parsed raises ValueError the first time (start-up) and later keeps the previous
    contents, with an error in the log, so one bad edit does not take the coordinator down.
    """

    missing_is_normal = False  # a missing file at the first reading is said at debug level only
    _shared: dict[tuple[type, Path], WatchedFile] = {}  # this process's watchers, by kind and file
    _shared_lock = threading.Lock()

    def __init__(self, path: str | Path | None, parse: Callable[[str, str], T], said: bool = False,
                 quiet: bool = False):
        self.path = Path(path) if path else None
        self._parse = parse
        self._signature: tuple | None = ()
        self._unusable: tuple | None = ()  # the signature of the file last found unusable (said once)
        self._lock = threading.Lock()
        # said: another process said the first reading (a rank's launcher); quiet: another one says every reading
        self._said_first, self.quiet = said, quiet
        self.value: T = parse("", "")
        self.refresh(strict=True)

    @classmethod
    def watching(cls, path: str | Path, said: bool = False, quiet: bool = False):
        """This process's one watcher of ``path`` (made, and read strictly, on first use), so that the parts of a
        service that check it (its control API, its agents' port, each run) read it once per change and say so once;
        ``said``: its first reading was said by another process; ``quiet``: another process says its readings. A
        later use keeps what was read when the file is unusable now, as the parts already watching it do: each run
        that started while it was failed for good ('cannot start: cannot use revoked.txt')."""
        key = (cls, Path(path).resolve())
        with cls._shared_lock:
            watcher = cls._shared.get(key)
            if watcher is None:
                cls._shared[key] = cls(path, said=said, quiet=quiet)  # read strictly: a start is refused
                return cls._shared[key]
        watcher.refresh()
        return watcher

    def refresh(self, strict: bool = False) -> T:
        """Re-read the file if it changed; returns the current parsed value."""
        if self.path is None:
            return self.value
        try:
            st = self.path.stat()
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            signature = None
        except OSError as exc:
            return self._failed(f"cannot stat {self.path}: {exc.strerror}", strict)
        with self._lock:
            # an unusable file is said once, not at each call that checks it (every few seconds, for as long as it
            # stays so); a start (strict) is refused each time
            if signature == self._signature or (signature == self._unusable and not strict):
                return self.value
            try:
                self.value = read_edited_file(self.path, self._parse) if signature is not None else \
                    self._parse("", str(self.path))
            except ValueError as exc:
                if not strict:
                    self._unusable = signature
                return self._failed(str(exc), strict)
            first, self._signature = self._signature == (), signature
        if self.quiet or (first and self._said_first):
            return self.value
        if signature is None:  # at first the normal state of a new deployment; gone later: what it held is dropped
            (log.debug if first and self.missing_is_normal else log.info)(
                "%s does not exist (yet): nothing in it applies", self.path)
        else:
            self._say_read()
        return self.value

    def _say_read(self) -> None:
        """Say that the file was read (again)."""
        log.info("read %s", self.path)

    def _failed(self, message: str, strict: bool) -> T:
        if strict:
            raise ValueError(message)
        log.error("%s; keeping its previous contents", message)
        return self.value


class RevocationList(WatchedFile):
    """Revoked agent ids and certificate serials from a file operators append to (missing: none revoked)."""

    missing_is_normal = True  # no agent revoked yet: every service's first start (it printed a line before its banner)

    def __init__(self, path: str | Path | None, said: bool = False, quiet: bool = False):
        super().__init__(path, parse_revocations, said, quiet)

    @property
    def ids(self) -> set[str]:
        """Revoked agent ids as last read."""
        return self.value[0]

    def is_revoked(self, agent_id: str, serial: int | None = None) -> bool:
        """Whether the agent id or the certificate serial is listed (call :meth:`refresh` first)."""
        ids, serials = self.value
        return agent_id in ids or (serial is not None and serial in serials)


class TokenList(WatchedFile):
    """Enrollment token hashes by agent id from a tokens file, re-read when it changes (new agents
    can be enrolled without restarting the coordinator)."""

    def __init__(self, path: str | Path, said: bool = False, quiet: bool = False):
        if not Path(path).exists():
            raise ValueError(f"enrollment tokens file {path} does not exist; make one with "
                             "'fedpar certs --out DIR --mint-token AGENT'")
        super().__init__(path, parse_token_hashes, said, quiet)

    def _say_read(self) -> None:
        """Say the reading; a file without a token is a warning: no agent can enroll until one is added."""
        if self.value:
            super()._say_read()
        else:
            log.warning("enrollment tokens file %s holds no tokens, so no agent can enroll: add one with 'fedpar certs "
                        "--out DIR --mint-token ID' (the file is re-read when it changes)", self.path)


class Admission:
    """Decides who may join and who may keep calling. With no options it admits anyone (plaintext tests)."""

    def __init__(self, allowed_ids: Iterable[str] | None = None,
                 token_hashes: Mapping[str, str] | TokenList | None = None,
                 revocations: RevocationList | None = None, require_certificate: bool = False):
        self.allowed_ids = set(allowed_ids) if allowed_ids is not None else None
        self.token_hashes = token_hashes  # None: no tokens; agents without certificates are admitted
        self.revocations = revocations or RevocationList(None)
        self.require_certificate = require_certificate
        # Whether check_call can refuse a call that proves no certificate: one is required, or agents can be revoked
        # (a revocation file, even one not written yet). If not (a plaintext coordinator with no revocation list),
        # such calls are not checked at all (server/registry.py).
        self.checks_uncertified_calls = require_certificate or self.revocations.path is not None

    def admit_join(self, agent_id: str, peer: PeerIdentity | None, enrollment_token: str = "") -> None:
        """Raise AdmissionRefused unless ``agent_id`` may join over a connection proving ``peer``."""
        self.check_call(agent_id, peer)
        if self.allowed_ids is not None and agent_id not in self.allowed_ids:
            raise AdmissionRefused(grpc.StatusCode.PERMISSION_DENIED,
                                   f"agent {agent_id!r} is not on this coordinator's allow-list; "
                                   "ask its operator to add it (--allow-agents)")
        if peer is None and self.token_hashes is not None:
            hashes = self.token_hashes.refresh() if isinstance(self.token_hashes, TokenList) else self.token_hashes
            expected = hashes.get(agent_id, "")
            ok_length = 0 < len(enrollment_token) <= MAX_TOKEN_CHARS
            given = hash_token(enrollment_token) if ok_length else "-"
            if not hmac.compare_digest(expected.encode(), given.encode()) or not expected:
                what = "wrong" if enrollment_token else "missing"
                raise AdmissionRefused(grpc.StatusCode.UNAUTHENTICATED,
                                       f"{what} enrollment token for agent {agent_id!r}; ask the operator for "
                                       "one ('fedpar certs --mint-token') and pass it with --enrollment-token-file")

    def check_call(self, agent_id: str, peer: PeerIdentity | None) -> None:
        """Raise AdmissionRefused if the certificate names someone else or is an operator's, or the agent was
        revoked."""
        if peer is None and self.require_certificate:
            raise AdmissionRefused(grpc.StatusCode.UNAUTHENTICATED,
                                   "this coordinator requires a client certificate signed by its CA")
        if peer is not None:
            _check_role(peer)
        if peer is not None and peer.common_name != agent_id:
            raise AdmissionRefused(grpc.StatusCode.PERMISSION_DENIED,
                                   f"the client certificate proves agent {peer.common_name!r}, but the request "
                                   f"names agent {agent_id!r}; use --agent-id {peer.common_name} or that "
                                   "agent's own certificate")
        self._check_revoked(agent_id, peer.serial if peer is not None else None)

    def check_peer(self, peer: PeerIdentity) -> None:
        """Raise AdmissionRefused if the client certificate is an operator's (the control API's, not an agent's) or
        was revoked (its serial, or the agent it names): checked at the start of every call, before anything is read
        or counted."""
        _check_role(peer)
        self._check_revoked(peer.common_name, peer.serial)

    def _check_revoked(self, agent_id: str, serial: int | None) -> None:
        self.revocations.refresh()
        if self.revocations.is_revoked(agent_id, serial):
            if agent_id in self.revocations.ids:  # by name: a new certificate of that name is refused as well
                what = f"agent {agent_id!r}"
                undo = f"its operator must remove {agent_id!r} from {self.revocations.path}"
            else:
                what, undo = f"the certificate (serial {serial:x}) of agent {agent_id!r}", "ask for a new certificate"
            raise AdmissionRefused(grpc.StatusCode.PERMISSION_DENIED,
                                   f"{what} was revoked by the coordinator's operator; it may not take part any "
                                   f"more (if this is a mistake, {undo})")

    def revoked_filter(self):
        """A predicate ``(agent_id, serial) -> revoked?`` on the current revocation list (read once)."""
        self.revocations.refresh()
        return self.revocations.is_revoked


def _check_role(peer: PeerIdentity) -> None:
    """An operator's certificate is for the control API: it may not speak as an agent."""
    if peer.role != "agent":
        raise AdmissionRefused(grpc.StatusCode.PERMISSION_DENIED,
                               f"{peer.describe()} has the {peer.role} role: it may use the control API only, not "
                               "join as an agent; give the agent its own certificate (fedpar certs --agents ID)")
