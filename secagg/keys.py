"""Key agreement (X25519 + HKDF-SHA256) and authenticated encryption (ChaCha20-Poly1305) of share messages.

Each client makes two X25519 pairs per round, as in Bonawitz et al. (2017): c (encryption of the Shamir
shares it routes through the server) and s (agreement of pairwise mask seeds). Keys never repeat across
rounds; HKDF info strings bind every derived key to its purpose, the round and the two parties.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedpar.secagg.errors import SecAggError

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16


def generate_private_key() -> X25519PrivateKey:
    """A fresh X25519 private key."""
    return X25519PrivateKey.generate()


def public_bytes(private: X25519PrivateKey) -> bytes:
    """The 32-byte raw public key of ``private``."""
    return private.public_key().public_bytes_raw()


def private_bytes(private: X25519PrivateKey) -> bytes:
    """The 32-byte raw private key (to be secret-shared)."""
    return private.private_bytes_raw()


def private_from_bytes(raw: bytes) -> X25519PrivateKey:
    """Load a raw 32-byte X25519 private key."""
    if len(raw) != KEY_BYTES:
        raise SecAggError(f"an X25519 private key is {KEY_BYTES} bytes, got {len(raw)}")
    return X25519PrivateKey.from_private_bytes(bytes(raw))


_PROBE = X25519PrivateKey.generate()


def check_public(raw: bytes) -> None:
    """Raise SecAggError unless ``raw`` is a usable X25519 public key (32 bytes, not a low-order point)."""
    if len(raw) != KEY_BYTES:
        raise SecAggError(f"an X25519 public key is {KEY_BYTES} bytes, got {len(raw)}")
    try:  # clamping makes every low-order point give the all-zero secret, which cryptography refuses
        _PROBE.exchange(X25519PublicKey.from_public_bytes(bytes(raw)))
    except ValueError:
        raise SecAggError("public key is a low-order point; it would make every derived key predictable") from None


def _info(purpose: bytes, round_id: int, a: str, b: str) -> bytes:
    first, second = sorted((a, b))
    parts = [purpose, struct.pack("<Q", round_id), first.encode(), second.encode()]
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def agree(private: X25519PrivateKey, peer_public: bytes, purpose: bytes, round_id: int, a: str, b: str) -> bytes:
    """HKDF-SHA256 of the X25519 shared secret, bound to purpose, round and the (unordered) pair a, b."""
    if len(peer_public) != KEY_BYTES:
        raise SecAggError(f"an X25519 public key is {KEY_BYTES} bytes, got {len(peer_public)}")
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
    except ValueError:  # low-order point: the shared secret would be all zeros
        raise SecAggError("peer public key is invalid (low-order point)") from None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=_info(purpose, round_id, a, b)).derive(shared)


def pairwise_mask_seed(s_private: X25519PrivateKey, peer_s_public: bytes, round_id: int, me: str, peer: str) -> bytes:
    """The seed both u and v derive for their pairwise mask in ``round_id``."""
    return agree(s_private, peer_s_public, b"fedpar-secagg pairwise mask", round_id, me, peer)


def share_encryption_key(c_private: X25519PrivateKey, peer_c_public: bytes, round_id: int, me: str, peer: str) -> bytes:
    """The symmetric key u and v use for share messages in ``round_id``."""
    return agree(c_private, peer_c_public, b"fedpar-secagg share encryption", round_id, me, peer)


def share_aad(round_id: int, sender: str, recipient: str) -> bytes:
    """Associated data binding a share ciphertext to its round, sender and recipient (direction matters)."""
    parts = [b"fedpar-secagg share", struct.pack("<Q", round_id), sender.encode(), recipient.encode()]
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def encrypt(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """nonce || ChaCha20-Poly1305(key, nonce, plaintext, aad) with a random nonce."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, aad)


def decrypt(key: bytes, blob: bytes, aad: bytes) -> bytes:
    """Open what :func:`encrypt` made; SecAggError if it was tampered with or is for someone else."""
    if len(blob) < NONCE_BYTES + TAG_BYTES:
        raise SecAggError("share ciphertext too short")
    try:
        return ChaCha20Poly1305(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
    except InvalidTag:
        raise SecAggError("share ciphertext failed authentication (tampered, or not meant for this agent)") from None
