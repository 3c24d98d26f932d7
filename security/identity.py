"""Who is on the other end of a gRPC call: the verified client certificate's subject CN, serial number and role."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cryptography import x509

from fedpar.security.certs import certificate_role


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
