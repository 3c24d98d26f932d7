"""Registry of live client agents: join, authenticate, liveness from their calls and heartbeats.

An agent (or simulation host) whose liveness expired leaves it; what authenticating a returning one needs, the example
count it declared first, stays in a compact map bounded by --max-agents (and, for agents, in the checkpoint).
"""

from __future__ import annotations

import base64
import bisect
import hmac
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from fedpar.security.admission import Admission, PeerIdentity

MAX_AGENT_ID = 128


class AuthError(Exception):
    """An unknown agent or a wrong session token."""


@dataclass(slots=True)  # a population of a million members holds a million of them
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


@dataclass
class HostRecord:
    """A simulation host: one process speaking for a slice of a virtual population (its members' liveness)."""

    host_id: str
    token: str
    last_seen: float = 0.0
    members: int = 0


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
        return self.fix_all([agent_id], [num_examples])[0]

    def fix_all(self, agent_ids: Sequence[str], counts: Sequence[int]) -> list[int]:
        """:meth:`fix` for each of ``agent_ids`` in turn (a host joins thousands of members in one call)."""
        caps, limit, out = self._caps, self.limit, []
        for agent_id, count in zip(agent_ids, counts):
            cap = caps.pop(agent_id, None)
            count = count if cap is None or cap >= count else cap
            caps[agent_id] = count
            out.append(count)
            if len(caps) > limit:
                del caps[next(iter(caps))]  # the longest-unseen
        return out

    def state(self) -> dict[str, int]:
        """The caps as JSON (id -> count, oldest join first)."""
        return dict(self._caps)

    def __len__(self) -> int:
        return len(self._caps)


INSERT_AT_MOST = 64  # ids that joined since the live ids were last read, put in place one by one; more: merged


class LiveIds(Sequence):
    """The sorted ids of the live agents, kept as agents come and go rather than made again each round: the ids that
    joined since it was last read wait unsorted and are merged in when an id is looked up, so counting them and
    sampling a cohort from them costs no pass over the population while it stays as it was."""

    def __init__(self, ids: list[str], key: object, valid_until: float):
        self._sorted, self._added = ids, []
        self.key, self.valid_until = key, valid_until  # what it was made from, and until when it holds

    def _merged(self) -> list[str]:
        if len(self._added) <= INSERT_AT_MOST:  # a few: each put in place (a move of the list's tail)
            for agent_id in self._added:
                bisect.insort(self._sorted, agent_id)
        else:
            self._sorted = sorted(self._sorted + self._added)  # sorted runs: merged, not sorted again
        self._added = []
        return self._sorted

    def __len__(self) -> int:
        return len(self._sorted) + len(self._added)

    def __getitem__(self, index):
        return self._merged()[index]

    def __iter__(self):
        return iter(self._merged())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, LiveIds)) else NotImplemented

    __hash__ = None  # it changes

    def __contains__(self, agent_id: object) -> bool:
        ids = self._merged()
        at = bisect.bisect_left(ids, agent_id)
        return at < len(ids) and ids[at] == agent_id

    def add(self, ids: list[str]) -> None:
        """Take ``ids``, live now and not held yet."""
        self._added.extend(sorted(ids))

    def discard(self, agent_id: str) -> None:
        """Drop ``agent_id`` if it is held."""
        if agent_id in self._added:
            self._added.remove(agent_id)
            return
        at = bisect.bisect_left(self._sorted, agent_id)
        if at < len(self._sorted) and self._sorted[at] == agent_id:
            del self._sorted[at]


class AgentRegistry:
    """Live agents and simulation hosts by id. Not thread-safe: the coordinator's event loop is its only user."""

    def __init__(self, liveness_timeout: float, clock=time.monotonic, admission: Admission | None = None,
                 max_known: int = 100_000):
        self.liveness_timeout = liveness_timeout
        self._clock = clock
        self.admission = admission or Admission()
        self._agents: dict[str, AgentRecord] = {}
        self._hosts: dict[str, HostRecord] = {}
        self.caps = ExampleCaps(max_known)  # agents' (checkpointed)
        self.member_caps = ExampleCaps(max_known)  # population members' (their hosts join them again after a restart)
        self._live: LiveIds | None = None  # kept up to date as they come and go; None: make it again
        self._plain: set[str] = set()  # ids of the agents that joined by themselves (not a host's members)

    def join(self, agent_id: str, num_examples: int, capabilities: dict[str, str],
             peer: PeerIdentity | None = None, enrollment_token: str = "",
             max_examples: int = 10_000_000) -> AgentRecord:
        """Register ``agent_id`` (or re-register it after a restart) with a fresh session token.

        The declared example count bounds the FedAvg weight of the agent's updates, so it must be in
        1..``max_examples``, and it is fixed by the agent's first Join of the run (a checkpoint's, after a
        restart): a later Join may lower it, never raise it. Raises ValueError on bad data and AdmissionRefused
        if the admission policy refuses the agent.
        """
        _check_member(agent_id, num_examples, max_examples)
        check_capabilities(capabilities)
        self.admission.admit_join(agent_id, peer, enrollment_token)
        num_examples = self.caps.fix(agent_id, num_examples)
        record = AgentRecord(agent_id, secrets.token_urlsafe(24), int(num_examples), dict(capabilities) or None,
                             last_seen=self._clock(), cert_serial=peer.serial if peer else None)
        self._newcomers([record])
        return record

    def join_population(self, host_id: str, host_token: str, members: list[tuple[str, int, bool]],
                        peer: PeerIdentity | None = None, enrollment_token: str = "",
                        max_examples: int = 10_000_000) -> tuple[HostRecord, list[AgentRecord]]:
        """Register (more of) ``host_id``'s population: each member gets its own session, live while the host
        calls. ``host_token``: empty on the host's first call, then the one it got. A member's example count is
        fixed by its first join, as for an agent; an id joined as an agent, or by another host, is refused.
        Raises ValueError on bad data (naming the member), AuthError on a wrong host token."""
        host = self._hosts.get(host_id)
        if host is not None and host_token:
            self.authenticate_host(host_id, host_token)
        else:
            _check_member(host_id, 1, 1)
            self.admission.admit_join(host_id, peer, enrollment_token)
            host = HostRecord(host_id, secrets.token_urlsafe(24), self._clock(), host.members if host else 0)
            self._hosts[host_id] = host
        bad = next((m for m in members if not _sane(m[0], m[1], max_examples)), None)
        if bad is not None:
            _check_member(bad[0], bad[1], max_examples)  # raises, naming it
        ids = [m[0] for m in members]
        known = [self._agents.get(agent_id) for agent_id in ids]
        taken = next((a for a, old in zip(ids, known) if old is not None and old.host != host_id), None)
        if taken is not None:
            raise ValueError(f"member {taken!r} is registered already, not by host {host_id!r}")
        host.members += known.count(None)
        counts = self.member_caps.fix_all(ids, [m[1] for m in members])
        serial = peer.serial if peer else None  # revoking the host's certificate revokes them
        records = [AgentRecord(agent_id, token, int(count), host=host_id, away=away, cert_serial=serial)
                   for agent_id, token, count, (_, _, away) in zip(ids, session_tokens(len(ids)), counts, members)]
        host.last_seen = self._clock()
        self._newcomers(records)
        return host, records

    def _newcomers(self, records: list[AgentRecord]) -> None:
        """Hold ``records``, and keep the live ids up to date: new live ids join them, a record replacing one held
        already joins or leaves them as its availability changed (made again at the next read if its certificate
        changed: its revocation may have)."""
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
            for agent_id in gone:
                self._live.discard(agent_id)
            self._live.add(fresh)

    def set_away(self, host_id: str, away: list[str], back: list[str]) -> None:
        """Mark members of ``host_id`` offline (``away``) or online again (``back``); others' ids are ignored."""
        for ids, flag in ((away, True), (back, False)):
            for agent_id in ids:
                record = self._agents.get(agent_id)
                if record is not None and record.host == host_id and record.away != flag:
                    record.away = flag
                    if self._live is not None and flag:
                        self._live.discard(agent_id)
                    elif self._live is not None and self.is_live(record):
                        self._live.add([agent_id])

    def authenticate_host(self, host_id: str, token: str, peer: PeerIdentity | None = None) -> HostRecord:
        """The host's record if ``token`` is its session token and the admission policy still admits it over a
        connection proving ``peer``; marks it (and so its members) seen."""
        self.admission.check_call(host_id, peer)
        host = self._hosts.get(host_id)
        if host is None or not hmac.compare_digest(host.token.encode(), token.encode()):
            raise AuthError(f"unknown host {host_id!r} or bad session token: call JoinPopulation again")
        host.last_seen = self._clock()
        return host

    def authenticate(self, agent_id: str, token: str, peer: PeerIdentity | None = None) -> AgentRecord:
        """The agent's record if ``token`` is its current session token and the admission policy still
        admits it over a connection proving ``peer`` (a population member: proving its host); marks it seen."""
        record = self._agents.get(agent_id)
        self.admission.check_call(speaker(record) if record is not None else agent_id, peer)
        if record is None or record.left:
            raise AuthError(f"unknown agent {agent_id!r}: call Join first")
        if not hmac.compare_digest(record.token.encode(), token.encode()):
            raise AuthError(f"bad session token for agent {agent_id!r}: call Join again")
        record.last_seen = self._clock()
        return record

    def admit_session(self, agent_id: str, token: str, num_examples: int, cert_serial: int | None,
                      host: str | None = None) -> AgentRecord:
        """Take a session that another registry issued (an aggregator rank takes rank 0's for the agents dealt
        to it); the agent authenticates here with the same token, identity and revocation checks (``host``: the
        simulation host that speaks for it, if it is a population member)."""
        record = AgentRecord(agent_id, token, int(num_examples), last_seen=self._clock(), cert_serial=cert_serial,
                             host=host)
        self._newcomers([record])
        return record

    def leave(self, agent_id: str) -> None:
        """Mark an agent as gone; it is not sampled until it joins again (and leaves at the next :meth:`expire`)."""
        if agent_id in self._agents:
            self._agents[agent_id].left = True
            if self._live is not None:
                self._live.discard(agent_id)

    def is_live(self, record: AgentRecord) -> bool:
        """Whether the agent (a population member: its host) has called recently enough to be sampled."""
        if record.left or record.away:
            return False
        if record.host is not None:
            host = self._hosts.get(record.host)
            return host is not None and self._clock() - host.last_seen <= self.liveness_timeout
        return self._clock() - record.last_seen <= self.liveness_timeout

    def live_ids(self) -> LiveIds:
        """Ids of live, not revoked agents, sorted (sampling is then deterministic for a seed). Made again (one pass
        over the agents, those whose liveness expired leaving first: :meth:`expire`) only when the revocation list
        changed or a liveness ran out; else as kept up to date by joins, leaves and availability. Whether a liveness
        ran out is a pass over the hosts and the agents that joined by themselves, not over a host's members."""
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
        live = [a for a in self._agents.values() if self.is_live(a) and not revoked(a.agent_id, a.cert_serial)]
        self._live = LiveIds(sorted(a.agent_id for a in live), key, min(now + self.liveness_timeout,
                                                                        self._live_until()))
        return self._live

    def _live_until(self) -> float:
        """When the first liveness runs out, unless its agent or host calls again: the oldest call of a host or of
        an agent (not a host's member) that has not left, plus the liveness timeout."""
        seen = [self._agents[a].last_seen for a in self._plain if not self._agents[a].left]
        seen += [h.last_seen for h in self._hosts.values()]
        return min(seen, default=self._clock()) + self.liveness_timeout

    def get(self, agent_id: str) -> AgentRecord | None:
        """The record of ``agent_id`` or None."""
        return self._agents.get(agent_id)

    def host(self, host_id: str) -> HostRecord | None:
        """The record of simulation host ``host_id`` or None."""
        return self._hosts.get(host_id)

    @property
    def host_count(self) -> int:
        """Simulation hosts held."""
        return len(self._hosts)

    def __len__(self) -> int:
        return len(self._agents)

    def expire(self, idle_seconds: float | None = None) -> int:
        """Forget agents that left or have been silent longer than ``idle_seconds`` (default: the liveness timeout),
        and hosts silent that long with their members; returns how many agents. Their example caps stay."""
        idle = self.liveness_timeout if idle_seconds is None else idle_seconds
        now = self._clock()
        for host_id in [h for h, r in self._hosts.items() if now - r.last_seen > idle]:
            del self._hosts[host_id]
        gone = [i for i, r in self._agents.items() if r.left
                or (r.host is None and now - r.last_seen > idle) or (r.host is not None and r.host not in self._hosts)]
        for agent_id in gone:
            del self._agents[agent_id]
            self._plain.discard(agent_id)
        if gone:
            self._live = None
        return len(gone)

    def restore(self, caps) -> None:
        """Take the example caps of a checkpoint's :meth:`snapshot` (or, from an older checkpoint, its list of
        agents); ValueError when an entry is not one. Sessions are never checkpointed: agents join again."""
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
            self.caps.fix(agent_id, count)

    def snapshot(self) -> dict[str, int]:
        """JSON-able view for checkpoints: the agents' example caps (no sessions: agents re-join after a restart;
        hosts join their members again)."""
        return self.caps.state()


def session_tokens(count: int) -> list[str]:
    """``count`` fresh session tokens like ``secrets.token_urlsafe(24)``'s, drawn at once (a host joins thousands)."""
    text = base64.urlsafe_b64encode(secrets.token_bytes(24 * count)).decode()
    return [text[32 * i:32 * i + 32] for i in range(count)]


def speaker(record: AgentRecord) -> str:
    """Whose identity (under mutual TLS: whose certificate) speaks for ``record``: its host's, for a population
    member, else its own."""
    return record.host or record.agent_id


def _sane(agent_id: str, num_examples: int, max_examples: int) -> bool:
    """Whether :func:`_check_member` lets ``agent_id`` and ``num_examples`` pass."""
    return bool(agent_id) and len(agent_id) <= MAX_AGENT_ID and agent_id.isprintable() \
        and 1 <= num_examples <= max_examples


def _check_member(agent_id: str, num_examples: int, max_examples: int) -> None:
    """A ValueError unless ``agent_id`` is a sane id and ``num_examples`` is in 1..``max_examples``."""
    if not agent_id or len(agent_id) > MAX_AGENT_ID or not agent_id.isprintable():
        raise ValueError(f"agent_id must be 1..{MAX_AGENT_ID} printable characters, got {agent_id[:40]!r}")
    if not 1 <= num_examples <= max_examples:
        raise ValueError(f"num_examples={num_examples} of {agent_id[:40]!r} must be in 1..{max_examples} "
                         "(--max-examples-per-agent)")
