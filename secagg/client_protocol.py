"""The client's side of SecAgg+: a state machine that answers each server broadcast with its next message.

Order: advertise() -> share_keys(KeyBroadcast) -> masked_input(RoutedShares, update, weight) ->
unmask(UnmaskRequest). Every incoming message is checked before anything changes; a bad one raises
SecAggError (and the client may simply not answer: to the server that is a dropout).
"""

from __future__ import annotations

import os

import numpy as np

from fedpar.secagg import keys, prg, shamir
from fedpar.secagg.errors import SecAggAbort, SecAggError
from fedpar.secagg.messages import (SHARE_CIPHERTEXT_BYTES, SHARE_HEADER, AdvertiseKeys, KeyBroadcast, MaskedInput,
                                    RoutedShares, ShareKeys, UnmaskRequest, UnmaskShares)
from fedpar.secagg.params import RoundParams

STAGES = ("advertise", "share", "mask", "unmask", "done")


class SecAggClient:
    """One client's secrets and view of one round."""

    def __init__(self, params: RoundParams, me: str, rng: np.random.Generator | None = None):
        params.validate()
        if me not in params.index:
            raise SecAggError(f"{me!r} is not a participant of round {params.round_id}")
        self.params = params
        self.me = me
        self.neighbours = params.neighbours_of(me)
        self.stage = "advertise"
        self._rng = rng or np.random.default_rng()
        self._c = keys.generate_private_key()
        self._s = keys.generate_private_key()
        self._b = os.urandom(shamir.SECRET_BYTES)
        self._peer_keys: dict[str, tuple[bytes, bytes]] = {}
        self._own_shares: tuple[bytes, bytes] | None = None  # (s_sk share, b share) held by the owner
        self._held: dict[str, tuple[bytes, bytes]] = {}  # owner -> (s_sk share, b share)

    def _expect(self, stage: str, recipient: str) -> None:
        if self.stage != stage:
            raise SecAggError(f"{self.me}: got a {stage!r} message in stage {self.stage!r}")
        if recipient != self.me:
            raise SecAggError(f"{self.me}: message is addressed to {recipient!r}")

    def advertise(self) -> AdvertiseKeys:
        """Stage 1: the two fresh public keys."""
        self._expect("advertise", self.me)
        self.stage = "share"
        return AdvertiseKeys(self.me, keys.public_bytes(self._c), keys.public_bytes(self._s))

    def share_keys(self, msg: KeyBroadcast) -> ShareKeys:
        """Stage 2: Shamir-share s_sk and b among the neighbours that advertised, encrypted to each."""
        self._expect("share", msg.recipient)
        p = self.params
        strangers = set(msg.keys) - self.neighbours
        if strangers:
            raise SecAggError(f"{self.me}: key broadcast names non-neighbours {sorted(strangers)[:3]}")
        mine = (keys.public_bytes(self._c), keys.public_bytes(self._s))
        seen = set(mine)
        for peer, pair in msg.keys.items():
            if len(pair) != 2 or any(len(k) != keys.KEY_BYTES for k in pair):
                raise SecAggError(f"{self.me}: public keys of {peer!r} are not two {keys.KEY_BYTES}-byte keys")
            if seen & set(pair) or pair[0] == pair[1]:
                raise SecAggError(f"{self.me}: public keys of {peer!r} repeat another key")
            seen.update(pair)
        holders = sorted(msg.keys) + [self.me]
        if len(holders) < p.threshold:
            raise SecAggAbort(f"{self.me}: only {len(holders) - 1} neighbours advertised keys; "
                              f"{p.threshold - 1} needed")
        xs = [p.index[h] for h in holders]
        s_shares = shamir.split(keys.private_bytes(self._s), p.threshold, xs)
        b_shares = shamir.split(self._b, p.threshold, xs)
        ciphertexts = {}
        for peer, (c_public, _) in msg.keys.items():
            key = keys.share_encryption_key(self._c, c_public, p.round_id, self.me, peer)
            x = p.index[peer]
            plaintext = SHARE_HEADER.pack(p.round_id, p.index[self.me], x) + s_shares[x] + b_shares[x]
            ciphertexts[peer] = keys.encrypt(key, plaintext, keys.share_aad(p.round_id, self.me, peer))
        me_x = p.index[self.me]
        self._own_shares = (s_shares[me_x], b_shares[me_x])
        self._peer_keys = dict(msg.keys)
        self.stage = "mask"
        return ShareKeys(self.me, ciphertexts)

    def masked_input(self, msg: RoutedShares, update: np.ndarray, weight: int) -> MaskedInput:
        """Stage 3: keep the shares addressed to us, then send q(w*x) masked by b and the pairwise seeds."""
        self._expect("mask", msg.recipient)
        p = self.params
        if np.asarray(update).size != p.vector_length:
            raise SecAggError(f"{self.me}: update has {np.asarray(update).size} values, "
                              f"the round expects {p.vector_length}")
        unknown = set(msg.ciphertexts) - set(self._peer_keys)
        if unknown:
            raise SecAggError(f"{self.me}: shares from parties that did not advertise to us: {sorted(unknown)[:3]}")
        held = {}
        for sender, blob in msg.ciphertexts.items():
            if len(blob) != SHARE_CIPHERTEXT_BYTES:
                raise SecAggError(f"{self.me}: share ciphertext from {sender!r} has {len(blob)} bytes, "
                                  f"expected {SHARE_CIPHERTEXT_BYTES}")
            key = keys.share_encryption_key(self._c, self._peer_keys[sender][0], p.round_id, self.me, sender)
            plain = keys.decrypt(key, blob, keys.share_aad(p.round_id, sender, self.me))
            header = SHARE_HEADER.unpack_from(plain)
            if header != (p.round_id, p.index[sender], p.index[self.me]):
                raise SecAggError(f"{self.me}: share message from {sender!r} names the wrong round or parties")
            body = plain[SHARE_HEADER.size:]
            held[sender] = (body[:shamir.SHARE_BYTES], body[shamir.SHARE_BYTES:])
        if len(held) + 1 < p.threshold:
            raise SecAggAbort(f"{self.me}: only {len(held)} neighbours shared keys; {p.threshold - 1} needed")
        vector = p.quantizer.quantize(update, weight, self._rng)
        masks = prg.MaskStream(vector.shape[0])
        masks.add(vector, self._b, prg.SELF_MASK_NONCE)
        for peer in held:
            seed = keys.pairwise_mask_seed(self._s, self._peer_keys[peer][1], p.round_id, self.me, peer)
            (masks.add if p.index[self.me] < p.index[peer] else masks.subtract)(vector, seed, prg.PAIR_MASK_NONCE)
        self._held = held
        self.stage = "unmask"
        return MaskedInput(self.me, vector)

    def unmask(self, msg: UnmaskRequest) -> UnmaskShares:
        """Stage 4: b shares of surviving holders' owners, s_sk shares of the dropped ones (never both)."""
        self._expect("unmask", msg.recipient)
        p = self.params
        survivors = set(msg.survivors)
        if len(survivors) != len(msg.survivors) or not survivors <= set(p.index):
            raise SecAggError(f"{self.me}: survivor list has duplicates or non-participants")
        if self.me not in survivors:
            raise SecAggError(f"{self.me}: survivor list leaves out this client, which did send its input")
        if len(survivors) < p.threshold:
            raise SecAggAbort(f"{self.me}: only {len(survivors)} survivors; refusing to unmask fewer than "
                              f"{p.threshold}")
        held = {**self._held, self.me: self._own_shares}
        b_shares = {owner: pair[1] for owner, pair in held.items() if owner in survivors}
        s_shares = {owner: pair[0] for owner, pair in held.items() if owner not in survivors}
        self.stage = "done"
        self._held = {}
        return UnmaskShares(self.me, b_shares, s_shares)
