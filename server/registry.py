"""Registry of live client agents and simulation hosts' members: join, authenticate, liveness from their calls and
heartbeats. A host's members are rows of arrays (server/member_table.py), not a record and a session each.

An agent (or simulation host) whose liveness expired leaves it; what authenticating a returning one needs, the example
count it declared first, stays in a compact map bounded by --max-agents (and, for agents, in the checkpoint).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import math
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from fedpar.protocol.codec import SESSION_FREE_IN, member_token
from fedpar.security.admission import Admission, PeerIdentity
from fedpar.server.member_table import (GONE, MAX_AGENT_ID, LiveIds, MemberTable, id_array, insert_sorted,
                                        parse_members)

# A round looks each sampled member up a few times (its task dealt, its update checked): its session token, an HMAC,
# is derived once for the recent ones. Bounded: a million members cost no token each.
_member_token = functools.lru_cache(maxsize=4096)(member_token)


class AuthError(Exception):
    """An unknown agent or a wrong session token."""


class SessionInUse(Exception):
    """A new session for an agent or a simulation host whose session another live process holds (and did not
    present); ``free_in``: the seconds until that process, unless heard from, is taken to be gone (None: it is
    running, its long-poll open)."""

    def __init__(self, message: str, free_in: float | None):
        super().__init__(message)
        self.free_in = free_in

    def refusal_trailing(self) -> tuple[tuple[str, str], ...]:
        """The refusal's trailing metadata: when the place is free (protocol/codec.SESSION_FREE_IN), if it may be."""
        return () if self.free_in is None else ((SESSION_FREE_IN, f"{self.free_in:.3f}"),)


@dataclass(frozen=True)
class SessionClaim:
    """Who asks for a new session at a Join: the session its process held (``replaces_token``; none on its first
    Join), the id its process drew once (``incarnation``: a Join sent again after its reply was lost is the same
    process's) and where the call came from (``address``)."""

    replaces_token: str = ""
    incarnation: str = ""
    address: str = ""


@dataclass(slots=True)
class AgentRecord:
    """One registered agent and what the coordinator knows of it."""

    agent_id: str
    token: str
    num_examples: int
    capabilities: dict[str, str] | None = None  # what an agent said it can do (members: None)
    last_seen: float = 0.0
    left: bool = False
    cert_serial: int | None = None  # of the client certificate it joined with (mutual TLS)
    host: str | None = None  # a simulated population's member: live while its host calls (JoinPopulation)
    # (its host's identity speaks for it: under mutual TLS its calls carry the host's certificate)
    away: bool = False  # a member its host reported offline (availability trace): not sampled meanwhile
    address: str = ""  # where its session's Join came from (said to another process that wants its place)
    incarnation: str = ""  # the id the process holding its session drew (SessionClaim)
    # when its long-poll was last cut short (registry clock): with no call since, its process is taken to be gone
    gone_at: float = -math.inf
    long_polls: int = 0  # open now: its process is running (one that dies ends them)


@dataclass
class HostRecord:
    """A simulation host: one process speaking for a slice of a virtual population (its members' liveness)."""

    host_id: str
    token: str
    last_seen: float = 0.0
    members: int = 0  # its members held
    index: int = 0  # in the member table's host column
    away: int = 0  # of its members, those it reported offline (availability trace)
    cert_serial: int | None = None  # of the client certificate it joined with (mutual TLS): its members' too
    address: str = ""  # where its session's first call came from (said to another process that wants its place)
    incarnation: str = ""  # the id the process holding its session drew (SessionClaim)
    # when its task stream last ended (registry clock): with no call since, its process is taken to be gone
    gone_at: float = -math.inf
    long_polls: int = 0  # task streams open now: its process is running (one that dies ends them)


def check_capabilities(capabilities: dict[str, str]) -> None:
    """ValueError unless ``capabilities`` (an agent's or a simulation host's, at Join) are within their bounds."""
    if len(capabilities) > 64 or any(len(k) > 64 or len(v) > 256 for k, v in capabilities.items()):
        raise ValueError("capabilities: at most 64 entries, keys <= 64 and values <= 256 characters")


class ExampleCaps:
    """The example count each id declared first in the run (a later join may lower it, never raise it), kept for the
    ``limit`` ids that joined most recently: beyond that the longest-unseen is forgotten."""

    def __init__(self, limit: int):
        self.limit = limit
        self._caps: dict[str, int] = {}  # oldest join first

    def capped(self, agent_id: str, num_examples: int) -> int:
        """``num_examples``, lowered to the cap of ``agent_id`` if it has one (nothing is recorded)."""
        cap = self._caps.get(agent_id)
        return num_examples if cap is None else min(num_examples, cap)

    def fix(self, agent_id: str, num_examples: int) -> int:
        """Record a join of ``agent_id`` declaring ``num_examples``; returns the count it gets (the capped one)."""
        cap = self._caps.pop(agent_id, None)
        count = num_examples if cap is None or cap >= num_examples else cap
        self._caps[agent_id] = count
        if len(self._caps) > self.limit:
            del self._caps[next(iter(self._caps))]  # the longest-unseen
        return count

    def state(self) -> dict[str, int]:
        """The caps as JSON (id -> count, oldest join first)."""
        return dict(self._caps)

    def __len__(self) -> int:
        return len(self._caps)


class AgentRegistry:
    """Live agents and simulation hosts by id, and the hosts' members in a :class:`MemberTable`. Not thread-safe: the
    coordinator's event loop is its only user."""

    def __init__(self, liveness_timeout: float, clock=time.monotonic, admission: Admission | None = None,
                 max_known: int = 100_000):
        self.liveness_timeout = liveness_timeout
        self._clock = clock
        self.admission = admission or Admission()
        self.max_known = max_known
        self._agents: dict[str, AgentRecord] = {}  # agents that joined by themselves, and sessions taken
        self._hosts: dict[str, HostRecord] = {}
        self._host_index: dict[str, int] = {}  # each host id ever joined: its index in the member table
        self._host_ids: list[str] = []  # ... and back
        self.caps = ExampleCaps(max_known)  # agents' (checkpointed)
        self.members = MemberTable()  # population members (their example counts stay when their host left)
        self._live: LiveIds | None = None  # kept up to date as they come and go; None: make it again
        self._plain: set[str] = set()  # ids of the agents that joined by themselves (not a host's members)

    def join(self, agent_id: str, num_examples: int, capabilities: dict[str, str],
             peer: PeerIdentity | None = None, enrollment_token: str = "",
             max_examples: int = 10_000_000, claim: SessionClaim = SessionClaim()) -> AgentRecord:
        """Register ``agent_id`` (or re-register it after a restart) with a fresh session token.

        The declared example count bounds the FedAvg weight of the agent's updates, so it must be in
        1..``max_examples``, and it is fixed by the agent's first Join of the run (a checkpoint's, after a
        restart): a later Join may lower it, never raise it. A new session replaces a live one only if ``claim``
        shows the same process asks (:meth:`_check_replaceable`).
        Raises ValueError on bad data, AdmissionRefused if the admission policy refuses the agent, SessionInUse
        when another live process holds the agent's session.
        """
        _check_member(agent_id, num_examples, max_examples)
        check_capabilities(capabilities)
        row = self.members.row(agent_id)
        if row is not None and row[1] != GONE:
            raise ValueError(f"{agent_id!r} is a member of simulation host {self._host_ids[row[1]]!r}; join with an "
                             "id of your own")
        self.admission.admit_join(agent_id, peer, enrollment_token)  # first: a stranger hears nothing of the agent
        held = self._agents.get(agent_id)
        if held is not None and not held.left and held.host is None:
            self._check_replaceable("agent", held, claim)
        num_examples = self.caps.fix(agent_id, num_examples)
        record = AgentRecord(agent_id, secrets.token_urlsafe(24), int(num_examples), dict(capabilities) or None,
                             last_seen=self._clock(), cert_serial=peer.serial if peer else None, address=claim.address,
                             incarnation=claim.incarnation)
        self._newcomers([record])
        return record

    def join_population(self, host_id: str, host_token: str, member_ids: str, num_examples: Sequence[int],
                        away: Sequence[int] = (), peer: PeerIdentity | None = None, enrollment_token: str = "",
                        max_examples: int = 10_000_000, claim: SessionClaim = SessionClaim()) -> HostRecord:
        """Register (more of) ``host_id``'s population, as JoinPopulation carries it (ids separated by newlines, each
        one's examples, the positions of those away): each member's session is derived from the host's
        (member_token), live while the host calls. ``host_token``: empty on the host's first call, then the one it
        got. A new session replaces a live one only if ``claim`` shows the same process asks
        (:meth:`_check_replaceable`). A member's example count is fixed by its first join, as for
        an agent; an id joined as an agent, or by another host, is refused. Raises ValueError on bad data (naming
        the member; nothing is registered), AuthError on a wrong host token, SessionInUse when another live process
        holds the host's session."""
        ids, sizes, offline = parse_members(member_ids, num_examples, away, max_examples)
        host = self._hosts.get(host_id)
        if host is not None and host_token:
            self.authenticate_host(host_id, host_token)
        else:
            _check_member(host_id, 1, 1)
        taken = self._plain.intersection(member_ids.split("\n")) if self._plain and len(ids) else ()
        if taken:
            raise ValueError(f"member {min(taken)!r} is registered already, not by host {host_id!r}")
        index = self._host_index.get(host_id, len(self._host_ids))
        table = self.members
        known, old_sizes, owners, was_away = table.read(ids)
        foreign = known & (owners != index) & (owners != GONE)
        if foreign.any():
            raise ValueError(f"member {ids[foreign][0].decode()!r} is registered already, not by host {host_id!r}")
        if host is None or not host_token:
            self.admission.admit_join(host_id, peer, enrollment_token)  # first: a stranger hears nothing of the host
            if host is not None:
                self._check_replaceable("host", host, claim)
            if index == len(self._host_ids):
                self._host_index[host_id] = index
                self._host_ids.append(host_id)
            host = HostRecord(host_id, secrets.token_urlsafe(24), self._clock(), host.members if host else 0,
                              index=index, away=host.away if host else 0, address=claim.address,
                              incarnation=claim.incarnation)
            self._hosts[host_id] = host
        serial = peer.serial if peer else None  # revoking the host's certificate revokes its members
        if host.cert_serial != serial:
            host.cert_serial, self._live = serial, None
        was_live = known & (owners == index) & ~was_away
        host.members += int((known & (owners == GONE)).sum()) + int((~known).sum())
        host.away += int(offline.sum()) - int((known & (owners == index) & was_away).sum())  # this call's now say
        table.write(ids[known], np.minimum(old_sizes, sizes)[known], index, offline[known])
        table.add(ids[~known], sizes[~known], index, offline[~known])
        host.last_seen = self._clock()
        if self._live is not None:
            self._live.discard(ids[was_live & offline])
            self._live.add(ids[~was_live & ~offline])
        return host

    def _check_replaceable(self, kind: str, held: AgentRecord | HostRecord, claim: SessionClaim) -> None:
        """SessionInUse unless a new session may take the place of ``held`` (an agent's or a host's, ``kind``): its
        process is not :meth:`connected`, or ``claim`` shows that process asks: it presents its session, or its
        incarnation (its first Join's reply was lost, so it has no session to present)."""
        if not self.connected(held) or hmac.compare_digest(held.token.encode(), claim.replaces_token.encode()):
            return
        if claim.incarnation and hmac.compare_digest(held.incarnation.encode(), claim.incarnation.encode()):
            return
        ident = held.agent_id if isinstance(held, AgentRecord) else held.host_id
        where = f"{kind} {ident!r} is already connected from {held.address or 'an unknown address'}"
        if held.long_polls:
            raise SessionInUse(f"{where} (its long-poll is open now: that process is running)", None)
        ago = max(0.0, self._clock() - held.last_seen)
        free_in = max(0.0, self.liveness_timeout - ago)
        raise SessionInUse(f"{where} (heard from {ago:.1f} s ago; if that process was killed, its place is free in "
                           f"{max(1, math.ceil(free_in))} s)", free_in)

    @staticmethod
    def another_process(held: AgentRecord | HostRecord | None, claim: SessionClaim) -> bool:
        """Whether ``claim`` comes from a process other than the one that held ``held``'s session (None: the session
        was forgotten): a process started again under the id, which presents no session it held, and not that
        one's incarnation (a process that held a session presents it when it joins again)."""
        if claim.replaces_token:
            return False
        return held is None or not claim.incarnation or not hmac.compare_digest(held.incarnation.encode(),
                                                                                claim.incarnation.encode())

    def connected(self, held: AgentRecord | HostRecord) -> bool:
        """Whether the process holding an agent's or a host's session is taken to be running: heard from within the
        liveness timeout (a live agent long-polls or heartbeats, a host calls), and not gone quiet since its
        long-poll (an agent's) or task stream (a host's) was cut (a process that exits or dies ends its calls)."""
        return self._clock() - held.last_seen <= self.liveness_timeout and held.last_seen > held.gone_at

    @staticmethod
    @contextlib.contextmanager
    def long_polling(held: AgentRecord | HostRecord) -> Iterator[None]:
        """While an agent's long-poll or a host's task stream is open: its process is running, and another asking
        for its place is told so, not to wait for it."""
        held.long_polls += 1
        try:
            yield
        finally:
            held.long_polls -= 1

    def calls_cut(self, held: AgentRecord | HostRecord) -> None:
        """The long-poll of an agent, or a host's task stream, ended with its caller gone: unless it calls again,
        another process may take its place at once."""
        held.gone_at = self._clock()

    def _newcomers(self, records: list[AgentRecord]) -> None:
        """Hold ``records`` (agents, and sessions taken), and keep the live ids up to date: new live ids join them, a
        record replacing one held already joins or leaves them as its availability changed (made again at the next
        read if its certificate changed: its revocation may have)."""
        fresh, gone = [], []
        agents, plain = self._agents, self._plain
        for record in records:
            old = agents.get(record.agent_id)  # (a record earlier in ``records`` with the same id, too)
            if old is not None and old.cert_serial != record.cert_serial:
                self._live = None
            elif old is not None and not (old.left or old.away) and record.away:
                gone.append(record.agent_id)
            elif (old is None or old.left or old.away) and not record.away:
                fresh.append(record.agent_id)
            agents[record.agent_id] = record
            if record.host is None:
                plain.add(record.agent_id)
            elif plain:
                plain.discard(record.agent_id)
        if self._live is not None:
            self._live.discard(id_array(gone))
            self._live.add(id_array(sorted(fresh)))

    def set_away(self, host_id: str, away: list[str], back: list[str]) -> None:
        """Mark members of ``host_id`` offline (``away``) or online again (``back``); others' ids are ignored."""
        index = self._host_index.get(host_id)
        for ids, flag in ((away, True), (back, False)):
            if index is None or not ids:
                continue
            named = id_array([i for i in ids if "\0" not in i])  # (a bytes array drops trailing NULs)
            changed = np.unique(self.members.set_away(named, index, flag))
            self._count_away(host_id, len(changed) if flag else -len(changed))
            if self._live is not None and flag:
                self._live.discard(changed)
            elif self._live is not None and host_id in self._hosts:
                self._live.add(changed)

    def _count_away(self, host_id: str, change: int) -> None:
        """Add ``change`` to the members ``host_id`` holds away."""
        host = self._hosts.get(host_id)
        if host is not None:
            host.away += change

    def away_count(self) -> int:
        """Members of the live simulation hosts that their host reported offline (one pass over the hosts)."""
        now = self._clock()
        return sum(r.away for r in self._hosts.values() if now - r.last_seen <= self.liveness_timeout)

    def authenticate_host(self, host_id: str, token: str, peer: PeerIdentity | None = None) -> HostRecord:
        """The host's record if ``token`` is its session token and the admission policy still admits it over a
        connection proving ``peer``; marks it (and so its members) seen."""
        self._check_call(host_id, peer)
        host = self._hosts.get(host_id)
        if host is None or not hmac.compare_digest(host.token.encode(), token.encode()):
            raise AuthError(f"unknown host {host_id[:64]!r} or bad session token: call JoinPopulation again")
        host.last_seen = self._clock()
        return host

    def authenticate(self, agent_id: str, token: str, peer: PeerIdentity | None = None) -> AgentRecord:
        """The agent's record if ``token`` is its current session token and the admission policy still
        admits it over a connection proving ``peer`` (a population member: proving its host); marks it seen."""
        record = self.get(agent_id)
        self._check_call(speaker(record) if record is not None else agent_id, peer)
        if record is None or record.left:
            raise AuthError(f"unknown agent {agent_id[:64]!r}: call Join first")
        if not hmac.compare_digest(record.token.encode(), token.encode()):
            raise AuthError(f"bad session token for agent {agent_id!r}: call Join again")
        record.last_seen = self._clock()
        return record

    def _check_call(self, who: str, peer: PeerIdentity | None) -> None:
        """The admission policy's check of a call by ``who`` over a connection proving ``peer`` (AdmissionRefused);
        none when the call proves no certificate and the policy could not refuse it
        (Admission.checks_uncertified_calls)."""
        if peer is not None or self.admission.checks_uncertified_calls:
            self.admission.check_call(who, peer)

    def admit_session(self, agent_id: str, token: str, num_examples: int, cert_serial: int | None,
                      host: str | None = None) -> AgentRecord:
        """Take a session that another registry issued (an aggregator rank takes rank 0's for the agents dealt
        to it); the agent authenticates here with the same token, identity and revocation checks (``host``: the
        simulation host that speaks for it, if it is a population member)."""
        record = AgentRecord(agent_id, token, int(num_examples), last_seen=self._clock(), cert_serial=cert_serial,
                             host=host)
        self._newcomers([record])
        return record

    def admit_host_session(self, host_id: str, token: str, cert_serial: int | None) -> HostRecord:
        """Take a simulation host's session that another registry issued (an aggregator rank takes rank 0's for the
        hosts of the members dealt to it), as :meth:`admit_session` takes an agent's; its members come as sessions."""
        host = self._hosts.get(host_id)
        if host is None or host.token != token or host.cert_serial != cert_serial:
            index = self._host_index.setdefault(host_id, len(self._host_ids))
            if index == len(self._host_ids):
                self._host_ids.append(host_id)
            host = self._hosts[host_id] = HostRecord(host_id, token, index=index, cert_serial=cert_serial)
        host.last_seen = self._clock()
        return host

    def leave(self, agent_id: str) -> None:
        """Mark an agent (or a member) as gone; it is not sampled until it joins again (an agent leaves the registry
        at the next :meth:`expire`)."""
        if agent_id in self._agents:
            self._agents[agent_id].left = True
        else:
            row = self.members.row(agent_id)
            if row is None:
                return
            if len(self.members.set_away(id_array([agent_id]), row[1], True)) and row[1] != GONE:
                self._count_away(self._host_ids[row[1]], 1)
        if self._live is not None:
            self._live.discard(id_array([agent_id]))

    def is_live(self, record: AgentRecord) -> bool:
        """Whether the agent (a population member: its host) has called recently enough to be sampled."""
        if record.left or record.away:
            return False
        if record.host is not None:
            host = self._hosts.get(record.host)
            return host is not None and self._clock() - host.last_seen <= self.liveness_timeout
        return self._clock() - record.last_seen <= self.liveness_timeout

    def live_ids(self) -> LiveIds:
        """Ids of live, not revoked agents and members, sorted (sampling is then deterministic for a seed). Made
        again (agents whose liveness expired leave first: :meth:`expire`; then one pass over the member arrays) only
        when the revocation list changed or a liveness ran out; else as kept up to date by joins, leaves and
        availability. Whether a liveness ran out is a pass over the hosts and the agents that joined by themselves,
        not over a host's members."""
        revoked = self.admission.revoked_filter()
        key = id(self.admission.revocations.value)  # a new list is a new object
        if self._live is not None and self._live.key == key:
            if self._clock() < self._live.valid_until:
                return self._live
            self._live.valid_until = self._live_until()
            if self._clock() < self._live.valid_until:  # all called again in time: still the same ids
                return self._live
        self.expire()
        now = self._clock()
        agents = sorted(self._agents.values(), key=lambda a: a.agent_id)  # the live ones set, the others there to be
        agents_live = np.array([self.is_live(a) and not revoked(a.agent_id, a.cert_serial) for a in agents], bool)
        hosts_live = np.zeros(len(self._host_ids) + 1, bool)  # the last: GONE's
        for host in self._hosts.values():
            hosts_live[host.index] = now - host.last_seen <= self.liveness_timeout \
                and not (host.cert_serial is not None and revoked("", host.cert_serial))
        ids, live = self.members.live(hosts_live, id_array(sorted(self.admission.revocations.ids)))
        if agents:
            ids, live = insert_sorted(ids, id_array([a.agent_id for a in agents]), (live, agents_live))
        self._live = LiveIds(ids, live, key, min(now + self.liveness_timeout, self._live_until()))
        return self._live

    def _live_until(self) -> float:
        """When the first liveness runs out, unless its agent or host calls again: the oldest call of a host or of
        an agent (not a host's member) that has not left, plus the liveness timeout."""
        seen = [self._agents[a].last_seen for a in self._plain if not self._agents[a].left]
        seen += [h.last_seen for h in self._hosts.values()]
        return min(seen, default=self._clock()) + self.liveness_timeout

    def get(self, agent_id: str) -> AgentRecord | None:
        """The record of ``agent_id`` or None (a population member's is made now, from its row and its host's)."""
        return self.get_many([agent_id])[0]

    def get_many(self, agent_ids: Sequence[str]) -> list[AgentRecord | None]:
        """The record of each of ``agent_ids`` (None for one not registered): the population members' rows read in
        one pass over the member table, as a round's cohort is looked up, not one pass each."""
        records = [self._agents.get(a) for a in agent_ids]
        members = [a for a, r in zip(agent_ids, records) if r is None]
        if not members:
            return records
        rows = iter(self.members.rows(members))
        for at, record in enumerate(records):
            if record is None:
                records[at] = self._member_record(agent_ids[at], next(rows))
        return records

    def member_hosts(self, agent_ids: Sequence[str]) -> list[tuple[str | None, int]]:
        """Each of ``agent_ids``' host and registered examples ((None, 0): no live member of a host), looked up as
        :meth:`get_many` looks them up but building no record (no session token derived)."""
        records = [self._agents.get(a) for a in agent_ids]
        members = [a for a, r in zip(agent_ids, records) if r is None]
        rows = iter(self.members.rows(members) if members else ())
        found = []
        for record in records:
            if record is not None:
                found.append((None, 0) if record.left else (record.host, record.num_examples))
                continue
            row = next(rows)
            host = self._row_host(row)
            found.append((None, 0) if host is None else (host.host_id, row[0]))
        return found

    def _row_host(self, row: tuple[int, int, bool] | None) -> HostRecord | None:
        """The host of a member's row; None if it has no row or its host left."""
        return self._hosts.get(self._host_ids[row[1]]) if row is not None and row[1] != GONE else None

    def _member_record(self, agent_id: str, row: tuple[int, int, bool] | None) -> AgentRecord | None:
        """A member's record from its row (and its host's record); None if it has none or its host left."""
        host = self._row_host(row)
        if host is None:
            return None
        return AgentRecord(agent_id, _member_token(host.token, agent_id), row[0], last_seen=host.last_seen,
                           cert_serial=host.cert_serial, host=host.host_id, away=row[2])

    def live_ids_without(self, host_ids: set[str]) -> list[str]:
        """The live ids less the members of the hosts ``host_ids`` (a pass over the live ids' arrays)."""
        live = self.live_ids()
        ids = live.array()
        _, _, hosts, _ = self.members.read(ids)
        out = np.isin(hosts, [self._host_index[h] for h in host_ids if h in self._host_index])
        return [i.decode() for i in ids[~out].tolist()]

    def live_hosts(self) -> list[str]:
        """The simulation hosts whose liveness holds (their members may be sampled)."""
        now = self._clock()
        return sorted(h for h, r in self._hosts.items() if now - r.last_seen <= self.liveness_timeout)

    def own_agents(self) -> list[AgentRecord]:
        """The live agents that joined by themselves (not a host's members)."""
        return [r for a in sorted(self._plain) if (r := self._agents.get(a)) is not None and self.is_live(r)]

    def host(self, host_id: str) -> HostRecord | None:
        """The record of simulation host ``host_id`` or None."""
        return self._hosts.get(host_id)

    @property
    def host_count(self) -> int:
        """Simulation hosts held."""
        return len(self._hosts)

    def __len__(self) -> int:
        """Agents and members of the hosts held."""
        return len(self._agents) + sum(h.members for h in self._hosts.values())

    def expire(self, idle_seconds: float | None = None) -> int:
        """Forget agents that left or have been silent longer than ``idle_seconds`` (default: the liveness timeout),
        and hosts silent that long with their members; returns how many agents and members. The example caps stay
        (of members: up to ``max_known`` whose host left)."""
        idle = self.liveness_timeout if idle_seconds is None else idle_seconds
        now = self._clock()
        quiet = [h for h, r in self._hosts.items() if now - r.last_seen > idle]
        members = sum(self._hosts.pop(h).members for h in quiet)
        if quiet:
            self.members.forget_hosts([self._host_index[h] for h in quiet], self.max_known)
        # a session taken from another registry (an aggregator rank's members) goes idle by itself, its host live or not
        gone = [i for i, r in self._agents.items() if r.left or now - r.last_seen > idle
                or (r.host is not None and r.host not in self._hosts)]
        for agent_id in gone:
            del self._agents[agent_id]
            self._plain.discard(agent_id)
        if gone or quiet:
            self._live = None
        return len(gone) + members

    def forget_host(self, host_id: str) -> int:
        """Forget host ``host_id`` (it left) and its members now, as :meth:`expire` forgets a silent one; how many
        members it had (0: it was not held)."""
        record = self._hosts.pop(host_id, None)
        if record is None:
            return 0
        self.members.forget_hosts([self._host_index[host_id]], self.max_known)
        for agent_id in [i for i, r in self._agents.items() if r.host == host_id]:
            del self._agents[agent_id]
            self._plain.discard(agent_id)
        self._live = None
        return record.members

    def restore(self, caps) -> None:
        """Make the example caps of a checkpoint's :meth:`snapshot` (or, from an older checkpoint, its list of
        agents; {}: none) the run's, in place of those held (a run's caps are its own); an agent joined already (a
        service's stay joined from run to run) is held to its cap there, as if it joined after the restore.
        ValueError when an entry is not one. Sessions are never checkpointed: after a restart agents join again."""
        self.caps = ExampleCaps(self.max_known)
        for agent_id, count in checked_caps(caps).items():
            self.caps.fix(agent_id, count)
        for record in self._agents.values():
            record.num_examples = self.caps.capped(record.agent_id, record.num_examples)

    def snapshot(self) -> dict[str, int]:
        """JSON-able view for checkpoints: the agents' example caps (no sessions: agents re-join after a restart;
        hosts join their members again)."""
        return self.caps.state()



def checked_caps(caps) -> dict[str, int]:
    """The example caps of a checkpoint's :meth:`AgentRegistry.snapshot` (or, from an older checkpoint, its list of
    agents); ValueError when an entry is not one."""
    if isinstance(caps, list):  # {"agent_id", "num_examples", ...} per agent
        try:
            caps = {entry["agent_id"]: entry["num_examples"] for entry in caps}
        except (KeyError, TypeError):
            raise ValueError(f"bad agent entry in checkpoint: {caps!r:.200}") from None
    if not isinstance(caps, dict):
        raise ValueError(f"example caps must be an object of id: count, not {type(caps).__name__}")
    for agent_id, count in caps.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 1 or not agent_id \
                or len(agent_id) > MAX_AGENT_ID or not agent_id.isprintable():
            raise ValueError(f"bad example cap in checkpoint: {agent_id[:40]!r}: {count!r:.40}")
    return caps


def speaker(record: AgentRecord) -> str:
    """Whose identity (under mutual TLS: whose certificate) speaks for ``record``: its host's, for a population
    member, else its own."""
    return record.host or record.agent_id


def _check_member(agent_id: str, num_examples: int, max_examples: int) -> None:
    """A ValueError unless ``agent_id`` is a sane id and ``num_examples`` is in 1..``max_examples``."""
    if not agent_id or len(agent_id) > MAX_AGENT_ID or not agent_id.isprintable():
        raise ValueError(f"agent_id must be 1..{MAX_AGENT_ID} printable characters, got {agent_id[:40]!r}")
    if not 1 <= num_examples <= max_examples:
        raise ValueError(f"num_examples={num_examples} of {agent_id[:40]!r} must be in 1..{max_examples} "
                         "(--max-examples-per-agent)")
