"""Why a TLS connection to the coordinator fails, in one line that says what to do.

gRPC reports a failed TLS handshake as UNAVAILABLE, like a coordinator that is not running, and keeps the
cause in its own log. :func:`diagnose_handshake` repeats the handshake with Python's ``ssl`` module and the same
CA, certificate and key, and classifies what it sees:

- the coordinator's certificate does not verify against our CA (unknown CA), names another host (name mismatch),
  or is expired: ``ssl.SSLCertVerificationError`` says which;
- the coordinator refuses our certificate: under TLS 1.3 the handshake completes on our side and the coordinator
  then closes the connection without a word (under TLS 1.2 it sends an alert). Our certificate is then checked
  against our own CA and its validity dates to say why, as far as can be told from here.

A coordinator whose TLS setting differs from the agent's (one started with --insecure, the other not) is no
certificate matter and may be restarted with the other setting, so the agent keeps retrying and says which flag
fits: :func:`tls_mismatch` asks the coordinator's port whether it speaks TLS (:func:`speaks_tls`).

fedpar's own revocation is not a TLS matter: a revoked agent completes the handshake and is refused with
PERMISSION_DENIED naming the revocation, which the agent reports as it is.

The lines name who dials whom (:class:`Dialler`): an agent its coordinator (``fedpar client``), or an operator a
service's control API (``fedpar run``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import ssl
import time
from dataclasses import dataclass

from cryptography import x509

from fedpar.security.certs import common_name
from fedpar.security.sslcontext import client_ssl_context
from fedpar.security.tls import TlsFiles, signed_by

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # preface + empty SETTINGS
HTTP1_HEAD = b"HEAD / HTTP/1.0\r\n\r\n"  # an HTTP/1 server answers it with its status line; gRPC's, with HTTP/2 frames
HTTP2_SETTINGS = 0x04  # the frame type a plaintext HTTP/2 server opens with
UNKNOWN_ISSUER = {2, 18, 19, 20, 21}  # X509_V_ERR_*: issuer not found / self-signed / unable to verify leaf
EXPIRED, NOT_YET_VALID, HOSTNAME_MISMATCH, IP_MISMATCH = 10, 9, 62, 64


@dataclass(frozen=True)
class Dialler:
    """Who dials what, in a diagnosis's words, and the options that fix it."""

    server: str = "the coordinator"
    us: str = "this agent"
    issued_with: str = "--agents ID"  # the option of 'fedpar certs' that makes our certificate
    ca_options: str = "--certs DIR or --tls-ca"
    address_option: str = "--server"
    name_option: str | None = "--tls-server-name NAME"
    port: str = "a coordinator's agents' port"  # the port ``address_option`` is for
    right_port: str = "the coordinator's --port"  # the option of the server that says which port that is


AGENT = Dialler()
OPERATOR = Dialler("the service", "this operator", "--operators NAME", "--certs DIR", "--control", None,
                   "a service's control API", "the service's --control-port")


def split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``HOST:PORT`` or ``[IPv6]:PORT`` address, or None if it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def lookup_trouble(address: str, flag: str, said: str = "") -> tuple[str, bool] | None:
    """Why the host name of ``address`` (given to ``flag``) cannot be looked up, and whether that lasts: a name the
    resolver knows nothing of, or one that cannot be a name (a label over 63 characters), against a lookup that failed
    for now (no DNS server answered: a machine without one, or an outage). None when it can be looked up. A failed
    gRPC call's words ``said`` settle it as lasting when they say resolving failed."""
    target = split_address(address)
    if "resol" not in said.lower():  # 'errors resolving ...', 'DNS resolution failed'
        if target is None:
            return None
        try:
            socket.getaddrinfo(*target, type=socket.SOCK_STREAM)
            return None
        except socket.gaierror as exc:
            if exc.errno not in _NO_SUCH_NAME:  # it may answer the next time
                return (f"the host name of {address} cannot be looked up now ({exc.strerror}): no DNS server "
                        f"answered; check this machine's DNS, or give {flag} an IP address"), False
        except (UnicodeError, ValueError):
            pass
    return f"the host name of {address} cannot be looked up (mistyped? a name no DNS server knows); check {flag}", True


_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def diagnose_handshake(address: str, files: TlsFiles, server_name: str | None = None,
                       timeout: float = 3.0, who: Dialler = AGENT) -> str | None:
    """What makes TLS to the coordinator at ``address`` fail, as one line, or None when TLS is not the problem
    (the handshake works, or nothing answers at all). ``server_name``: the name its certificate is checked for
    when it is not the host of ``address``; ``who``: whose words (an agent's, an operator's). A refusal of our
    certificate is reported only when seen twice, so a coordinator that closes connections while it stops is not
    taken for one."""
    target = split_address(address)
    if target is None:
        return None
    name = server_name or target[0]
    verdict = _handshake(target, files, name, timeout)
    if verdict is _REFUSED_OURS:
        time.sleep(0.2)
        verdict = _handshake(target, files, name, timeout)
    if verdict is None:
        return None
    if verdict is _NOT_GRPC:  # gRPC's words: 'Cannot check peer: missing selected ALPN property'
        server = who.server.removeprefix("the ")
        return (f"{address} speaks TLS but not gRPC (a {server}'s --data-port?): it is not {who.port}; give "
                f"{who.address_option} {who.right_port}")
    where = f"TLS handshake with {who.server} at {address} failed"
    if verdict is _REFUSED_OURS and files.cert is None:
        return (f"{where}: {who.server} requires a client certificate (mutual TLS) and {who.us} has none; "
                "pass --certs DIR holding this agent's ID.pem/ID.key (or --tls-cert/--tls-key), or have its operator "
                "admit agents by token ('fedpar serve --enrollment-tokens FILE', server-only TLS)")
    if verdict is _REFUSED_OURS:
        return f"{where}: {who.server} refused {who.us}'s certificate {files.cert}: {_why_refused(files, who)}"
    if isinstance(verdict, ssl.SSLCertVerificationError):
        return f"{where}: {_why_unverified(verdict, target, files, name, timeout, who)}"
    if "ALERT" in (verdict.reason or ""):  # a TLS 1.2 coordinator says why it refused our certificate
        alert = verdict.reason.split("ALERT_", 1)[-1].replace("_", " ").lower()
        return (f"{where}: {who.server} refused {who.us}'s certificate {files.cert} ({alert}): "
                f"{_why_refused(files, who)}")
    return f"{where}: {verdict.reason or verdict}; check {who.ca_options} and {who.server}'s TLS options"


def speaks_tls(address: str, timeout: float = 3.0) -> bool | None:
    """Whether the server at ``address`` answers a TLS ClientHello in TLS (True) or in plaintext HTTP/2 (False);
    None when that cannot be told (nothing listens, it hangs up, or it answers something else)."""
    # A probe, not gRPC's error text: a plaintext channel to a TLS port and a TLS channel to a plaintext port both
    # end as UNAVAILABLE with details that vary across gRPC versions ("Socket closed", "Connection reset", "Ssl
    # handshake failed"), and a handshake's own errors say little more. The bytes a server sends back do not vary:
    # a TLS server answers a ClientHello with a TLS record (handshake 0x16, or an alert 0x15), and a plaintext
    # gRPC server sends its HTTP/2 SETTINGS frame as soon as the connection opens, whatever it was sent.
    kind = _answer_kind(_answer_to(address, _client_hello(), timeout))
    return True if kind == TLS else False if kind == PLAINTEXT_GRPC else None


TLS, PLAINTEXT_GRPC, OTHER = "tls", "plaintext gRPC", "other"  # what a server answers a ClientHello in


def _answer_kind(answer: bytes | None) -> str | None:
    """What a server's first bytes to a TLS ClientHello are in: TLS (a handshake record 0x16, or an alert 0x15),
    PLAINTEXT_GRPC (an HTTP/2 SETTINGS frame) or OTHER (another protocol's); None when it said nothing."""
    if not answer:
        return None
    if answer[:1] in (b"\x16", b"\x15"):
        return TLS
    return PLAINTEXT_GRPC if len(answer) >= 4 and answer[3] == HTTP2_SETTINGS else OTHER


def answers_another_protocol(address: str, timeout: float = 3.0, who: Dialler = AGENT) -> str | None:
    """What to change when the server at ``address`` answers a TLS ClientHello in neither TLS nor gRPC (another
    program's port: SSH, a database); None when it answers in either, or says nothing."""
    if _answer_kind(_answer_to(address, _client_hello(), timeout)) != OTHER:
        return None
    return (f"{address} answers in neither TLS nor gRPC (another program's port?): it is not {who.port}; give "
            f"{who.address_option} {who.right_port}")


def answers_http1(address: str, timeout: float = 3.0, who: Dialler = AGENT) -> str | None:
    """What to change when the server at ``address`` answers in HTTP/1 (a web server, or a coordinator's metrics
    port), which no gRPC client can talk to; None when it does not, or nothing answers. ``who``: whose words."""
    answer = _answer_to(address, HTTP1_HEAD, timeout)  # a request an HTTP/1 server answers (a ClientHello is none)
    if answer is None or not answer.startswith(b"HTTP/"):
        return None
    server = who.server.removeprefix("the ")
    return (f"{address} answers in HTTP/1, not gRPC: it is a web server (a {server}'s --metrics-port?), not "
            f"{who.port}; give {who.address_option} {who.right_port}")


def _answer_to(address: str, hello: bytes, timeout: float) -> bytes | None:
    """The first bytes (5 at most) the server at ``address`` answers ``hello`` with; None when nothing listens
    there or the address cannot be read."""
    target = split_address(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=timeout) as conn:
            conn.sendall(hello)
            return _read_at_least(conn, 5)
    except OSError:
        return None


NO_CONNECTION, NO_ANSWER = "no connection", "no answer"  # how a server stays silent (silence_at)


def silence_at(address: str, timeout: float = 3.0) -> str | None:
    """How the server at ``address`` stays silent to a TLS ClientHello for ``timeout`` s: NO_ANSWER when it took the
    TCP connection and said nothing (a stopped or overloaded process looks like that from outside), NO_CONNECTION when
    the connection was neither taken nor refused (a host that is down, a wrong address, a firewall dropping packets),
    None when it answered, hung up or refused, or the address cannot be read."""
    target = split_address(address)
    if target is None:
        return None
    try:
        conn = socket.create_connection(target, timeout=timeout)
    except TimeoutError:
        return NO_CONNECTION
    except (OSError, UnicodeError, ValueError):  # refused, no route, a name that cannot be encoded: not silence
        return None
    with conn:
        try:
            conn.sendall(_client_hello())
            conn.recv(1)
        except TimeoutError:  # its first byte did not come
            return NO_ANSWER
        except OSError:  # reset: not silence
            return None
    return None


def tls_mismatch(address: str, insecure: bool, timeout: float = 3.0) -> str | None:
    """What to change when the coordinator at ``address`` speaks TLS and this agent does not (``insecure``), or
    the other way round; None when they agree or it cannot be told (e.g. the coordinator is down)."""
    speaks = speaks_tls(address, timeout)
    if insecure and speaks is True:
        return ("it seems to require TLS: drop --insecure and pass --certs DIR (its 'fedpar certs' folder) or "
                "--tls-ca CA.pem")
    if not insecure and speaks is False:
        return ("it seems not to speak TLS (started with --insecure?): pass --insecure to this agent "
                "(on a network you trust), or restart the coordinator with --certs DIR")
    return None


def _client_hello() -> bytes:
    """The bytes of a TLS ClientHello (offering HTTP/2, as gRPC does), made by Python's ``ssl`` in memory."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    outgoing = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):  # it waits for the ServerHello it will never get
        tls.do_handshake()
    return outgoing.read()


def _read_at_least(conn: socket.socket, size: int) -> bytes:
    """Up to ``size`` bytes (fewer if the peer hangs up first)."""
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            break
        data += more
    return data


_REFUSED_OURS = object()  # the handshake completed on our side, then the coordinator hung up
_NOT_GRPC = object()  # the handshake completed without HTTP/2, which every gRPC server picks (a data plane picks none)


def _handshake(target: tuple[str, int], files: TlsFiles, name: str, timeout: float):
    """None (fine, or unreachable), _REFUSED_OURS, _NOT_GRPC, or the ssl.SSLError the handshake ended with."""
    context = client_ssl_context(files)
    context.set_alpn_protocols(["h2"])  # gRPC closes connections that do not offer HTTP/2
    handshake_done = False
    try:
        with socket.create_connection(target, timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=name) as tls:
                handshake_done = True
                if tls.selected_alpn_protocol() != "h2":
                    return _NOT_GRPC
                # Under TLS 1.3 the coordinator checks our certificate after our side is done: a coordinator that
                # accepts it answers the HTTP/2 preface with its SETTINGS, one that refuses it hangs up.
                tls.sendall(HTTP2_PREFACE)
                return None if tls.recv(64) else _REFUSED_OURS
    except ssl.SSLCertVerificationError as exc:
        return exc
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionResetError, BrokenPipeError):
        # Hung up after our side of the handshake: our certificate was refused. Hung up during it: unclear.
        return _REFUSED_OURS if handshake_done and files.cert is not None else None
    except ssl.SSLError as exc:
        return exc
    except (OSError, UnicodeError):  # refused, timed out, no route, a name that cannot be encoded: not a TLS matter
        return None


def _why_unverified(exc: ssl.SSLCertVerificationError, target: tuple[str, int], files: TlsFiles, name: str,
                    timeout: float, who: Dialler) -> str:
    """What is wrong with the coordinator's certificate, and what to do."""
    code = exc.verify_code
    if code in UNKNOWN_ISSUER:
        return (f"its certificate is not signed by the CA in {files.ca} ({exc.verify_message}); give {who.us} the "
                f"ca.pem of the folder that issued {who.server}'s certificate ({who.ca_options})")
    if code in (HOSTNAME_MISMATCH, IP_MISMATCH):
        names = _served_names(target, files, name, timeout)
        valid = f" (it is valid for {', '.join(names)})" if names else ""
        pass_name = f", or pass {who.name_option}" if who.name_option else ""
        return (f"its certificate is not valid for the name {name!r} {who.us} dialled{valid}; dial it by one of "
                f"its names in {who.address_option}{pass_name}, or have its operator re-issue it with "
                f"'fedpar certs --out DIR --server-name {name}'")
    if code in (EXPIRED, NOT_YET_VALID):
        return (f"its certificate {exc.verify_message} (check this machine's clock too); its operator must re-issue "
                f"it ('fedpar certs --out DIR --server-name NAME') and restart {who.server}")
    return f"its certificate does not verify ({exc.verify_message}); check {who.ca_options}"


def _served_names(target: tuple[str, int], files: TlsFiles, name: str, timeout: float) -> list[str]:
    """The DNS names and IP addresses the coordinator's certificate is valid for (read without verifying it)."""
    context = client_ssl_context(files)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(target, timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=name) as tls:
                der = tls.getpeercert(binary_form=True)
        san = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (OSError, ValueError, x509.ExtensionNotFound):
        return []
    return [*san.value.get_values_for_type(x509.DNSName),
            *(str(ip) for ip in san.value.get_values_for_type(x509.IPAddress))]


def _why_refused(files: TlsFiles, who: Dialler) -> str:
    """Why the coordinator may have refused our certificate, as far as our own files tell, and what to do."""
    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        cas = x509.load_pem_x509_certificates(files.ca.read_bytes())
    except (OSError, ValueError):
        cert, cas = None, []
    if cert is not None:
        now = dt.datetime.now(dt.timezone.utc)
        if cert.not_valid_after_utc < now:
            again = who.issued_with.split()[0]
            return (f"it expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; have a new one issued "
                    f"('fedpar certs --out DIR {again} {common_name(cert)} --force')")
        if cert.not_valid_before_utc > now:
            return (f"it is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC; check this machine's "
                    f"clock and {who.server}'s")
        if not any(signed_by(cert, ca) for ca in cas):
            issuer = ("another CA of the same name (another 'fedpar certs' folder)"
                      if any(cert.issuer == ca.subject for ca in cas) else repr(cert.issuer.rfc4514_string()))
            return (f"it was not issued by the CA in {files.ca} but by {issuer}; use the certificate and key made "
                    f"for {who.us} in {who.server}'s certificate folder ('fedpar certs --out DIR {who.issued_with}')")
    return (f"{who.server} does not trust the CA that issued it, or it was revoked; ask {who.server}'s "
            f"operator for a certificate from its CA ('fedpar certs --out DIR {who.issued_with}')")

