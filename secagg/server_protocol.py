"""The server's side of SecAgg+: collects and routes messages stage by stage, then removes the masks.

Order: receive_advertise()* -> close_advertising() -> key_broadcast(v) for each v -> receive_shares()* ->
close_sharing() -> routed_shares(v) -> receive_masked()* -> close_masking() -> unmask_request(v) ->
receive_unmask()* -> finish(). A bad message raises SecAggError and changes nothing; a round that cannot
complete raises SecAggAbort and reveals nothing. The running sum of masked inputs is the only
model-sized state (one uint32 vector), whatever the number of clients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedpar.secagg import keys, prg, shamir
from fedpar.secagg.errors import SecAggAbort, SecAggError, SecAggStageError
from fedpar.secagg.field import DTYPE, add_into
from fedpar.secagg.messages import (SHARE_CIPHERTEXT_BYTES, AdvertiseKeys, KeyBroadcast, MaskedInput, RoutedShares,
                                    ShareKeys, UnmaskRequest, UnmaskShares)
from fedpar.secagg.params import RoundParams


@dataclass
class SecAggResult:
    """What the server learns: the weighted sum of the survivors' (clipped) updates and their weight sum."""

    weighted_sum: np.ndarray  # float64, length vector_length
    weight_sum: int
    survivors: tuple[str, ...]  # whose inputs are in the sum
    dropped: tuple[str, ...]  # shared keys but sent no input (their pairwise masks were removed)
    error_bound: float  # largest quantization error of weighted_sum / weight_sum per coordinate

    @property
    def mean(self) -> np.ndarray:
        """The weighted mean update."""
        return self.weighted_sum / self.weight_sum


class SecAggServer:
    """The server's view of one round."""

    def __init__(self, params: RoundParams):
        params.validate()
        self.params = params
        self.stage = "advertise"
        self._keys: dict[str, tuple[bytes, bytes]] = {}  # U1: sender -> (c_public, s_public)
        self._seen_keys: set[bytes] = set()
        self._shares: dict[str, dict[str, bytes]] = {}  # U2: sender -> recipient -> ciphertext
        self._survivors: list[str] = []  # U3, in arrival order
        self._sum: np.ndarray | None = None
        self._unmask: dict[str, UnmaskShares] = {}  # U4

    # ------------------------------------------------------------------ helpers
    def _require(self, stage: str, sender: str, allowed, what: str) -> None:
        if self.stage == "aborted":
            raise SecAggAbort(f"round {self.params.round_id} was aborted")
        if self.stage != stage:
            raise SecAggStageError(f"{what} from {sender!r} arrived in stage {self.stage!r}, expected in {stage!r}")
        if sender not in self.params.index:
            raise SecAggError(f"{what} from {sender!r}, who is not a participant of round {self.params.round_id}")
        if sender not in allowed:
            raise SecAggStageError(f"{what} from {sender!r}, who did not complete the previous stage")

    def _abort(self, reason: str) -> None:
        self.stage = "aborted"
        self._sum = None
        raise SecAggAbort(f"round {self.params.round_id}: {reason}")

    def _close(self, stage: str, done, next_stage: str, what: str) -> None:
        if self.stage != stage:
            raise SecAggError(f"cannot close {stage!r} in stage {self.stage!r}")
        if len(done) < self.params.threshold:
            self._abort(f"only {len(done)} clients {what}; at least {self.params.threshold} are needed")
        self.stage = next_stage

    def holders(self, owner: str) -> set[str]:
        """Parties holding shares of ``owner``'s secrets: its neighbours that advertised, and itself."""
        return (self.params.graph[owner] & self._keys.keys()) | {owner}

    @property
    def advertised(self) -> tuple[str, ...]:
        """U1."""
        return tuple(sorted(self._keys))

    @property
    def shared(self) -> tuple[str, ...]:
        """U2."""
        return tuple(sorted(self._shares))

    @property
    def responded(self) -> tuple[str, ...]:
        """U4: survivors that sent their unmask shares."""
        return tuple(sorted(self._unmask))

    @property
    def survivors(self) -> tuple[str, ...]:
        """U3: clients whose masked input is in the sum."""
        return tuple(sorted(self._survivors))

    # ------------------------------------------------------------------ stage 1
    def receive_advertise(self, msg: AdvertiseKeys) -> None:
        """Record a client's public keys."""
        self._require("advertise", msg.sender, self.params.index, "advertised keys")
        if msg.sender in self._keys:
            raise SecAggError(f"{msg.sender!r} already advertised keys in round {self.params.round_id}")
        pair = (bytes(msg.c_public), bytes(msg.s_public))
        if any(len(k) != keys.KEY_BYTES for k in pair):
            raise SecAggError(f"public keys from {msg.sender!r} must be {keys.KEY_BYTES} bytes each")
        if pair[0] == pair[1] or self._seen_keys & set(pair):
            raise SecAggError(f"public keys from {msg.sender!r} repeat a key already seen this round")
        for key in pair:
            keys.check_public(key)
        self._keys[msg.sender] = pair
        self._seen_keys.update(pair)

    def close_advertising(self) -> None:
        """End stage 1 (everyone answered, or the stage timed out)."""
        self._close("advertise", self._keys, "share", "advertised keys")

    def key_broadcast(self, recipient: str) -> KeyBroadcast:
        """The public keys of ``recipient``'s neighbours that advertised."""
        self._require("share", recipient, self._keys, "key request")
        return KeyBroadcast(recipient, {v: self._keys[v] for v in self.params.graph[recipient] if v in self._keys})

    # ------------------------------------------------------------------ stage 2
    def receive_shares(self, msg: ShareKeys) -> None:
        """Record a client's encrypted share messages (one per neighbour that advertised)."""
        self._require("share", msg.sender, self._keys, "shares")
        if msg.sender in self._shares:
            raise SecAggError(f"{msg.sender!r} already sent its shares in round {self.params.round_id}")
        expected = self.holders(msg.sender) - {msg.sender}
        if set(msg.ciphertexts) != expected:
            raise SecAggError(f"shares from {msg.sender!r} must be addressed to exactly its {len(expected)} "
                              f"neighbours that advertised; got {len(msg.ciphertexts)} recipients")
        if any(len(ct) != SHARE_CIPHERTEXT_BYTES for ct in msg.ciphertexts.values()):
            raise SecAggError(f"share ciphertexts from {msg.sender!r} must be {SHARE_CIPHERTEXT_BYTES} bytes")
        self._shares[msg.sender] = {r: bytes(ct) for r, ct in msg.ciphertexts.items()}

    def close_sharing(self) -> None:
        """End stage 2."""
        self._close("share", self._shares, "mask", "shared keys")

    def routed_shares(self, recipient: str) -> RoutedShares:
        """The ciphertexts addressed to ``recipient`` by its neighbours that shared."""
        self._require("mask", recipient, self._shares, "share request")
        return RoutedShares(recipient, {u: self._shares[u][recipient] for u in self.params.graph[recipient]
                                        if u in self._shares})

    # ------------------------------------------------------------------ stage 3
    def receive_masked(self, msg: MaskedInput) -> None:
        """Add a client's masked input to the running sum (mod 2^32)."""
        self._require("mask", msg.sender, self._shares, "masked input")
        if msg.sender in self._survivors:
            raise SecAggError(f"{msg.sender!r} already sent its masked input in round {self.params.round_id}")
        vector = msg.vector
        length = self.params.vector_length + 1
        if not isinstance(vector, np.ndarray) or vector.dtype != DTYPE or vector.shape != (length,):
            raise SecAggError(f"masked input from {msg.sender!r} must be a little-endian uint32 vector of "
                              f"{length} values")
        if self._sum is None:
            self._sum = np.zeros(length, dtype=DTYPE)
        add_into(self._sum, vector)
        self._survivors.append(msg.sender)

    def close_masking(self) -> None:
        """End stage 3: whoever shared keys but sent no input counts as dropped."""
        self._close("mask", self._survivors, "unmask", "sent masked inputs")

    def unmask_request(self, recipient: str) -> UnmaskRequest:
        """Tell a survivor who survived."""
        self._require("unmask", recipient, self._survivors, "unmask request")
        return UnmaskRequest(recipient, self.survivors)

    # ------------------------------------------------------------------ stage 4
    def receive_unmask(self, msg: UnmaskShares) -> None:
        """Record a survivor's shares; they must be for exactly the owners it holds shares of."""
        self._require("unmask", msg.sender, self._survivors, "unmask shares")
        if msg.sender in self._unmask:
            raise SecAggError(f"{msg.sender!r} already sent its unmask shares in round {self.params.round_id}")
        held = ((self.params.graph[msg.sender] & self._shares.keys()) | {msg.sender})
        alive = set(self._survivors)
        if set(msg.self_mask_shares) != held & alive or set(msg.key_shares) != held - alive:
            raise SecAggError(f"unmask shares from {msg.sender!r} must cover exactly the surviving (b) and dropped "
                              "(s_sk) owners it holds shares of")
        for share in (*msg.self_mask_shares.values(), *msg.key_shares.values()):
            if len(share) != shamir.SHARE_BYTES:
                raise SecAggError(f"shares from {msg.sender!r} must be {shamir.SHARE_BYTES} bytes each")
        self._unmask[msg.sender] = msg

    def finish(self) -> SecAggResult:
        """Reconstruct the secrets, remove every mask and return the sums; SecAggAbort if that is impossible."""
        if self.stage != "unmask":
            raise SecAggError(f"cannot finish in stage {self.stage!r}")
        p = self.params
        if len(self._unmask) < p.threshold:
            self._abort(f"only {len(self._unmask)} survivors sent unmask shares; at least {p.threshold} are needed")
        total = self._sum
        masks = prg.MaskStream(total.shape[0])
        alive = set(self._survivors)
        for owner in sorted(alive):
            masks.subtract(total, self._reconstruct(owner, "self_mask_shares", "self-mask seed"), prg.SELF_MASK_NONCE)
        for owner in sorted(set(self._shares) - alive):
            raw = self._reconstruct(owner, "key_shares", "mask key")
            private = keys.private_from_bytes(raw)
            if keys.public_bytes(private) != self._keys[owner][1]:
                self._abort(f"the reconstructed mask key of dropped client {owner!r} does not match its public key")
            for v in sorted(p.graph[owner] & alive):  # v added sign(v, owner) * PRG(s_{v,owner})
                seed = keys.pairwise_mask_seed(private, self._keys[v][1], p.round_id, owner, v)
                (masks.subtract if p.index[v] < p.index[owner] else masks.add)(total, seed, prg.PAIR_MASK_NONCE)
        try:
            weighted_sum, weight_sum = p.quantizer.dequantize_sum(total)
        except SecAggAbort as exc:
            self._abort(str(exc))
        self.stage = "done"
        self._sum = None
        n = len(alive)
        return SecAggResult(weighted_sum, weight_sum, self.survivors, tuple(sorted(set(self._shares) - alive)),
                            p.quantizer.error_bound(n, weight_sum))

    def _reconstruct(self, owner: str, field: str, what: str) -> bytes:
        p = self.params
        shares = {p.index[v]: getattr(msg, field)[owner] for v, msg in self._unmask.items()
                  if owner in getattr(msg, field)}
        if len(shares) < p.threshold:
            self._abort(f"only {len(shares)} shares of the {what} of {owner!r} arrived; {p.threshold} are needed "
                        "(too many clients dropped)")
        try:
            return shamir.combine(shares, p.threshold)
        except SecAggAbort as exc:
            self._abort(f"{what} of {owner!r}: {exc}")
