"""Expand a 32-byte seed into a pseudorandom uint32 mask vector with the ChaCha20 stream cipher."""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedpar.secagg.errors import SecAggError
from fedpar.secagg.field import DTYPE

SEED_BYTES = 32
# cryptography's ChaCha20 nonce is 16 bytes: a 4-byte little-endian block counter (start at 0) and a
# 12-byte nonce. Every seed is fresh per round and per purpose (random, or HKDF output with its own info
# string), so a fixed nonce per purpose never encrypts twice under one key.
SELF_MASK_NONCE = bytes(4) + b"fedpar-self\0"
PAIR_MASK_NONCE = bytes(4) + b"fedpar-pair\0"
MAX_LENGTH = (1 << 32) * 16  # the 32-bit block counter covers 2^32 blocks of 16 uint32s


def expand(seed: bytes, length: int, nonce: bytes) -> np.ndarray:
    """``length`` uint32 values of ChaCha20(seed, nonce) keystream (a read-only array)."""
    if len(seed) != SEED_BYTES:
        raise SecAggError(f"mask seed must be {SEED_BYTES} bytes, got {len(seed)}")
    if not 0 <= length <= MAX_LENGTH:
        raise SecAggError(f"mask length {length} out of range")
    encryptor = Cipher(algorithms.ChaCha20(bytes(seed), nonce), mode=None).encryptor()
    stream = encryptor.update(bytes(length * DTYPE.itemsize))
    return np.frombuffer(stream, dtype=DTYPE)
