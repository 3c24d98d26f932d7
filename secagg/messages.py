"""The messages of the four SecAgg stages, as plain dataclasses (bytes, ints, strings, uint32 arrays)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from fedpar.secagg import keys, shamir

# Plaintext of one encrypted share message: round, sender x, recipient x, share of s_sk, share of b.
SHARE_HEADER = struct.Struct("<QII")
SHARE_PLAINTEXT_BYTES = SHARE_HEADER.size + 2 * shamir.SHARE_BYTES
SHARE_CIPHERTEXT_BYTES = keys.NONCE_BYTES + SHARE_PLAINTEXT_BYTES + keys.TAG_BYTES


@dataclass(frozen=True)
class AdvertiseKeys:
    """Stage 1, client -> server: the sender's two public keys for this round."""

    sender: str
    c_public: bytes  # share encryption
    s_public: bytes  # pairwise mask agreement


@dataclass(frozen=True)
class KeyBroadcast:
    """Stage 1 reply, server -> client: public keys (c, s) of the recipient's neighbours that advertised."""

    recipient: str
    keys: dict[str, tuple[bytes, bytes]]


@dataclass(frozen=True)
class ShareKeys:
    """Stage 2, client -> server: one encrypted share message per neighbour, for the server to route."""

    sender: str
    ciphertexts: dict[str, bytes]  # recipient -> ciphertext


@dataclass(frozen=True)
class RoutedShares:
    """Stage 2 reply, server -> client: the ciphertexts addressed to the recipient."""

    recipient: str
    ciphertexts: dict[str, bytes]  # sender -> ciphertext


@dataclass(frozen=True)
class MaskedInput:
    """Stage 3, client -> server: y = q(w*x) + PRG(b) + sum of signed pairwise masks (mod 2^32)."""

    sender: str
    vector: np.ndarray  # uint32, length vector_length + 1


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 3 reply, server -> client: who delivered a masked input (everyone else in stage 2 dropped)."""

    recipient: str
    survivors: tuple[str, ...]


@dataclass(frozen=True)
class UnmaskShares:
    """Stage 4, client -> server: shares of b for survivors and of s_sk for dropped neighbours."""

    sender: str
    self_mask_shares: dict[str, bytes]  # owner -> Shamir share of the owner's self-mask seed b
    key_shares: dict[str, bytes]  # owner -> Shamir share of the owner's s private key
