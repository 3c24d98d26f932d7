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
SLACK = 64  # update_into wants room for one cipher block beyond the data


class MaskStream:
    """Mask vectors of one length, written into one reused buffer.

    Reusing the buffers matters: a fresh 4 MB array per mask costs more in page faults than ChaCha20
    itself (measured 4-10x slower per 1M-value mask on this machine).
    """

    def __init__(self, length: int):
        if not 0 <= length <= MAX_LENGTH:
            raise SecAggError(f"mask length {length} out of range")
        self.length = length
        self._zeros = bytes(length * DTYPE.itemsize)
        self._buffer = bytearray(length * DTYPE.itemsize + SLACK)
        self._view = np.frombuffer(self._buffer, dtype=DTYPE, count=length)

    def fill(self, seed: bytes, nonce: bytes) -> np.ndarray:
        """The mask of ``seed`` (a view of the shared buffer: valid until the next call)."""
        if len(seed) != SEED_BYTES:
            raise SecAggError(f"mask seed must be {SEED_BYTES} bytes, got {len(seed)}")
        encryptor = Cipher(algorithms.ChaCha20(bytes(seed), nonce), mode=None).encryptor()
        encryptor.update_into(self._zeros, self._buffer)
        return self._view

    def add(self, acc: np.ndarray, seed: bytes, nonce: bytes) -> None:
        """acc += mask(seed) mod 2^32."""
        np.add(acc, self.fill(seed, nonce), out=acc)

    def subtract(self, acc: np.ndarray, seed: bytes, nonce: bytes) -> None:
        """acc -= mask(seed) mod 2^32."""
        np.subtract(acc, self.fill(seed, nonce), out=acc)


def expand(seed: bytes, length: int, nonce: bytes) -> np.ndarray:
    """``length`` uint32 values of ChaCha20(seed, nonce) keystream, in a fresh array."""
    return MaskStream(length).fill(seed, nonce)
