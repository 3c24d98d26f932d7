"""How fedpar's members are named in Flower's messages: node ids, the same on the client and the coordinator side."""

from __future__ import annotations

import hashlib

SERVER_NODE_ID = 1  # the ServerApp's side of a message (Flower's SuperLink node id)


def node_id_of(member_id: str) -> int:
    """The Flower node id of fedpar member ``member_id``: a stable 63-bit hash of its id (never 0 or 1)."""
    return max(2, int.from_bytes(hashlib.blake2b(member_id.encode(), digest_size=8).digest(), "big") >> 1)
