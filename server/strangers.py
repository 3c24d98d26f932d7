"""Bounds on work done for peers that have not authenticated yet (gRPC streams awaiting their header, data-plane
connections awaiting their handshake and ticket), per peer and in total.

When a bound is full the *oldest* waiting entry is let go, not the newcomer (preferring one that has sent nothing
we have not read, when the owner can tell): an honest agent authenticates within milliseconds of connecting, so a
stranger's silent calls can fill the bound but never lock out an agent sharing its address (NAT, loopback). Used
from the event loop and from data-plane threads, so it locks.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

import grpc

from fedpar.server.rounds import Refusal

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


class Stranger:
    """One unauthenticated call or connection; ``evict(refusal)`` is how its owner is told to let it go."""

    __slots__ = ("peer", "evict", "quiet", "evicted", "started", "_bound")

    def __init__(self, bound: StrangerBound, peer: str, evict: Callable[[Refusal], None],
                 quiet: Callable[[], bool] | None = None):
        self._bound, self.peer, self.evict, self.quiet = bound, peer, evict, quiet
        self.evicted: Refusal | None = None  # set when a bound or its deadline let it go
        self.started = time.monotonic()

    def done(self) -> None:
        """It authenticated or ended: it no longer counts (idempotent)."""
        self._bound.remove(self)


class StrangerBound:
    """At most ``total`` unauthenticated entries, at most ``per_peer`` of them from one peer (oldest out first)."""

    def __init__(self, total: int, per_peer: int, total_option: str, per_peer_option: str, what: str):
        self.total, self.per_peer = total, per_peer
        self._options = (total_option, per_peer_option)
        self._what = what
        self._all: OrderedDict[Stranger, None] = OrderedDict()
        self._by_peer: dict[str, OrderedDict[Stranger, None]] = {}
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._all)

    def admit(self, peer: str, evict: Callable[[Refusal], None], quiet: Callable[[], bool] | None = None) -> Stranger:
        """Count a new unauthenticated entry from ``peer``; beyond either bound lets the oldest go (``evict``),
        the oldest ``quiet()`` one (nothing unread from it) if there is one."""
        entry = Stranger(self, peer, evict, quiet)
        victims: list[Stranger] = []
        with self._lock:
            mine = self._by_peer.setdefault(peer, OrderedDict())
            if len(mine) >= self.per_peer:
                victims.append(self._pop(_victim(mine), self._refusal(f"from {peer} ", self.per_peer, 1)))
            if len(self._all) >= self.total:
                victims.append(self._pop(_victim(self._all), self._refusal("", self.total, 0)))
            mine[entry] = None
            self._all[entry] = None
            self.evictions += len(victims)
        for victim in victims:  # outside the lock: an owner may close a socket
            victim.evict(victim.evicted)
        return entry

    def expire(self, seconds: float, refusal: Refusal) -> None:
        """Let go (``evict``) every entry waiting longer than ``seconds``: a hard deadline however it trickles."""
        victims: list[Stranger] = []
        limit = time.monotonic() - seconds
        with self._lock:
            while self._all and (oldest := next(iter(self._all))).started < limit:
                victims.append(self._pop(oldest, refusal))
        for victim in victims:
            victim.evict(victim.evicted)

    def remove(self, entry: Stranger) -> None:
        """Stop counting ``entry`` (no-op if it was let go or removed already)."""
        with self._lock:
            if entry in self._all:
                del self._all[entry]
                self._drop_from_peer(entry)

    def _pop(self, entry: Stranger, refusal: Refusal) -> Stranger:
        del self._all[entry]
        self._drop_from_peer(entry)
        entry.evicted = refusal
        return entry

    def _drop_from_peer(self, entry: Stranger) -> None:
        mine = self._by_peer[entry.peer]
        del mine[entry]
        if not mine:
            del self._by_peer[entry.peer]

    def _refusal(self, scope: str, limit: int, option: int) -> Refusal:
        return Refusal(EXHAUSTED, f"more than {limit} unauthenticated {self._what} {scope}at once "
                                  f"({self._options[option]} {limit}); the oldest was let go: authenticate "
                                  "as soon as you connect")


def _victim(entries: OrderedDict[Stranger, None]) -> Stranger:
    """The oldest entry that is quiet, else the oldest."""
    for entry in entries:
        if entry.quiet is not None and entry.quiet():
            return entry
    return next(iter(entries))
