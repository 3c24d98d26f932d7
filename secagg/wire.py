"""Conversions between the SecAgg stage dataclasses and their protobuf carriers (SecAggExchange).

The sender of every incoming message is the authenticated agent, never a field inside the message;
repeated entries for one peer are refused rather than silently merged.
"""

from __future__ import annotations

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.secagg.errors import SecAggError
from fedpar.secagg.messages import AdvertiseKeys, KeyBroadcast, RoutedShares, ShareKeys, UnmaskRequest, UnmaskShares

MAX_ITEMS = 10_000


def _unique(pairs, what: str) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise SecAggError(f"{what} lists {key!r} twice")
        out[key] = value
        if len(out) > MAX_ITEMS:
            raise SecAggError(f"{what} has more than {MAX_ITEMS} entries")
    return out


def advertise_to_pb(msg: AdvertiseKeys) -> pb.SecAggPublicKeys:
    """Stage 1 request body."""
    return pb.SecAggPublicKeys(agent_id=msg.sender, c_public=msg.c_public, s_public=msg.s_public)


def advertise_from_pb(sender: str, body: pb.SecAggPublicKeys) -> AdvertiseKeys:
    """Stage 1 message of the authenticated ``sender``."""
    if body.agent_id and body.agent_id != sender:
        raise SecAggError(f"public keys name agent {body.agent_id!r}, but the caller is {sender!r}")
    return AdvertiseKeys(sender, bytes(body.c_public), bytes(body.s_public))


def key_broadcast_to_pb(msg: KeyBroadcast) -> pb.SecAggKeys:
    """Stage 1 reply body."""
    return pb.SecAggKeys(items=[pb.SecAggPublicKeys(agent_id=a, c_public=c, s_public=s)
                                for a, (c, s) in sorted(msg.keys.items())])


def key_broadcast_from_pb(recipient: str, body: pb.SecAggKeys) -> KeyBroadcast:
    """The neighbours' keys as the client state machine takes them."""
    return KeyBroadcast(recipient, _unique(((k.agent_id, (bytes(k.c_public), bytes(k.s_public))) for k in body.items),
                                           "key broadcast"))


def ciphertexts_to_pb(items: dict[str, bytes]) -> pb.SecAggCiphertexts:
    """Stage 2 request body (peer = recipient) or reply body (peer = sender)."""
    return pb.SecAggCiphertexts(items=[pb.SecAggCiphertext(peer=p, ciphertext=c) for p, c in sorted(items.items())])


def share_keys_from_pb(sender: str, body: pb.SecAggCiphertexts) -> ShareKeys:
    """Stage 2 message of the authenticated ``sender``."""
    return ShareKeys(sender, _unique(((c.peer, bytes(c.ciphertext)) for c in body.items), "share message"))


def routed_shares_from_pb(recipient: str, body: pb.SecAggCiphertexts) -> RoutedShares:
    """Stage 2 reply as the client state machine takes it."""
    return RoutedShares(recipient, _unique(((c.peer, bytes(c.ciphertext)) for c in body.items), "routed shares"))


def unmask_request_from_pb(recipient: str, body: pb.SecAggSurvivors) -> UnmaskRequest:
    """Stage 3 reply as the client state machine takes it."""
    return UnmaskRequest(recipient, tuple(body.agent_ids))


def unmask_shares_to_pb(msg: UnmaskShares) -> pb.SecAggUnmaskShares:
    """Stage 4 request body."""
    return pb.SecAggUnmaskShares(
        self_mask_shares=[pb.SecAggShare(owner=o, share=s) for o, s in sorted(msg.self_mask_shares.items())],
        key_shares=[pb.SecAggShare(owner=o, share=s) for o, s in sorted(msg.key_shares.items())])


def unmask_shares_from_pb(sender: str, body: pb.SecAggUnmaskShares) -> UnmaskShares:
    """Stage 4 message of the authenticated ``sender``."""
    return UnmaskShares(sender, _unique(((s.owner, bytes(s.share)) for s in body.self_mask_shares), "self-mask shares"),
                        _unique(((s.owner, bytes(s.share)) for s in body.key_shares), "key shares"))
