"""The coordinator's member source: who may be sampled, how a cohort is drawn from them (seeded, its RNG state kept in
checkpoints as JSON) and how a sampled member hears of its task.

:class:`Members` holds the agents that joined by themselves (Join; each long-polls PullTask for its own tasks).
server/populations.py extends it with simulation hosts that speak for slices of a virtual population. The
coordinator is given one and calls it only through these methods; all run on the coordinator's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol, Sequence

import grpc
import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.security.admission import AdmissionRefused, PeerIdentity
from fedpar.server.config import CoordinatorConfig
from fedpar.server.deadline import set_within
from fedpar.server.member_table import LiveIds
from fedpar.server.registry import AgentRecord, AgentRegistry, HostRecord, SessionClaim, SessionInUse
from fedpar.server.rounds import Refusal, RoundState

log = logging.getLogger("fedpar.server")


class TooFewMembers(TimeoutError):
    """Too few members to start a round came (or were online) in the time allowed: said in one line."""


class TaskDesk(Protocol):
    """What a member source asks the coordinator: the task a member is due, and the run's progress."""

    finished: bool
    keeps_members: bool  # a service's next run takes the members: they never hear that training is over
    handed_over: bool  # another coordinator takes the agents' calls now: a long-poll here ends at once
    round_id: int
    current: RoundState | None
    clock: object  # its RoundClock (server/coordinator.py)

    def task_for(self, agent: AgentRecord, finished_task_id: str = "",
                 with_weights: bool = True) -> pb.PullTaskReply | None:
        """The reply to a poll of ``agent`` now (its task, or that training is over); None: nothing yet."""

    def finished_reason(self) -> str:
        """The one line a member hears when training is over."""

    def inline_weights(self) -> tuple[bytes, bytes] | None:
        """The current round's small model (serialized ModelHeader, tensor bytes), None if it is not sent inline."""

    def task_failed(self, agent_id: str, task_id: str, reason: str) -> None:
        """A member's own code failed its task (``reason``: one line): it answered with no update."""


def _too_few_online(live: int, joined: int, least: int, wait_seconds: float) -> str:
    """The line for a wait that ended with enough members joined but fewer than ``least`` of them online by their
    availability traces."""
    secure = " (a secure round needs 2)" if least > 1 else ""
    return (f"{live} of the {joined:,} clients that joined came online in {wait_seconds:.0f} s{secure}: their "
            "availability traces keep the others offline (on the real clock a trace day lasts --trace-day-seconds "
            "real seconds); give a shorter --trace-day-seconds, or --clock virtual to move on through the traces' "
            "night")


class Members:
    """Agents that joined by themselves: the registry's agents, the wake-up of each one's long-poll, and who has
    heard that training is over."""

    def __init__(self, config: CoordinatorConfig, registry: AgentRegistry):
        self.config = config
        self.registry = registry
        self._wakeups: dict[str, asyncio.Event] = {}  # per long-poller (see :meth:`poller`)
        self._not_yet_told: set[str] = set()  # long-pollers live at the end not yet told that training is over
        self._changed = asyncio.Event()  # binds to the loop that first waits on it (the serving loop)
        self.needs_task: str | None = None  # a service's run: only agents declaring this task are sampled
        self._on_lacking: Callable[[str, str], None] = lambda agent_id, why: None  # told once per agent skipped
        self._lacking: set[str] = set()  # agents (and simulation hosts) that do not declare ``needs_task``
        self._lacking_hosts: set[str] = set()  # simulation hosts that do not: none of their members is sampled
        # one-shot serve's one run (see refuse_other_tasks): the flags of its task, which an agent or host with
        # another one is told to start with, else None
        self._refusal_hint: str | None = None
        self._same_task: Callable[[str, str], bool] = lambda declared, needed: declared == needed
        self.live_seen = 0  # the members live when the coordinator last waited for them (read from other threads)
        # told (kind "agent" or "host", its id) when a process started again under an id joins: the coordinator
        # hands it the open tasks its killed process held (set by the coordinator that takes these members' calls)
        self.on_restart: Callable[[str, str], None] = lambda kind, ident: None

    # ----------------------------------------------------------------- joining and leaving
    def join(self, agent_id: str, num_examples: int, capabilities: dict[str, str],
             peer: PeerIdentity | None = None, enrollment_token: str = "",
             claim: SessionClaim = SessionClaim()) -> AgentRecord:
        """Register an agent; raises Refusal on bad identity data, if the agent is not admitted, and ALREADY_EXISTS
        when another live process holds its session (``claim``: who asks, server/registry.py). A process started
        again under the id is told to the coordinator (:attr:`on_restart`)."""
        held = self.registry.get(agent_id)
        try:
            record = self.registry.join(agent_id, num_examples, capabilities, peer, enrollment_token,
                                        self.config.max_examples_per_agent, claim)
        except ValueError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except SessionInUse as exc:  # said here too: the operator sees why an agent went away
            log.warning("refused a second process for agent %r from %s: %s", agent_id, claim.address or "?", exc)
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS, str(exc), trailing=exc.refusal_trailing()) from None
        except AdmissionRefused as exc:
            log.warning("refused to admit agent %r: %s", agent_id[:128], exc.message)
            raise Refusal(exc.code, exc.message) from None
        if self._refused(agent_id, capabilities.get("task")):
            self.registry.leave(agent_id)  # admitted first: a stranger hears nothing of the run's task
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, self._other_task(agent_id, capabilities.get("task")))
        self._wakeups.setdefault(agent_id, asyncio.Event())
        self._check_task(agent_id, capabilities.get("task"))
        self._joined()
        if self.registry.another_process(held if held is not None and held.host is None else None, claim):
            self.on_restart("agent", agent_id)
        return record

    def require_task(self, task: str | None, on_lacking: Callable[[str, str], None] = lambda agent_id, why: None
                     ) -> None:
        """Sample only agents that declare ``task`` (None: every agent); ``on_lacking(agent_id, why)`` names each
        other one once: those joined already now (a service's agents stay joined from run to run), the others as
        they join. Called before the coordinator serves, or on its loop."""
        self.needs_task, self._on_lacking = task, on_lacking
        self._lacking.clear()
        self._lacking_hosts.clear()
        self._check_joined()

    def refuse_other_tasks(self, flags: str, same: Callable[[str, str], bool]) -> None:
        """One-shot serve's one run: an agent whose declared task is not the run's (``same(declared, needed)``
        says) can never take part, so its Join is refused in one line naming both tasks and the ``flags`` to start it
        with, and a simulation host's JoinPopulation likewise; an agent that declares no task (an older fedpar) is
        sampled, as before services. Called before the coordinator serves."""
        self._refusal_hint, self._same_task = flags, same

    def _refused(self, agent_id: str, task: str | None, who: str = "agent") -> bool:
        """Whether the Join of ``agent_id``, declaring ``task``, is refused for it (:meth:`refuse_other_tasks`); the
        first refusal of each agent is told to ``on_lacking``."""
        if self._refusal_hint is None or self.needs_task is None or not task \
                or self._same_task(task, self.needs_task):
            return False
        if agent_id not in self._lacking:
            self._lacking.add(agent_id)
            self._on_lacking(agent_id, self._other_task(agent_id, task, who))
        return True

    def _other_task(self, agent_id: str, task: str, who: str = "agent") -> str:
        """The line that refuses ``who`` ``agent_id``, which declared ``task``, the run's."""
        return (f"{who} {agent_id} cannot take part: it has task {task!r}, this run needs {self.needs_task!r}; "
                f"start {'the agent' if who == 'agent' else 'it'} with the coordinator's {self._refusal_hint}")

    def _check_joined(self) -> None:
        """:meth:`_check_task` for each live agent, by the task it declared at Join."""
        for record in self.registry.own_agents():
            self._check_task(record.agent_id, (record.capabilities or {}).get("task"))

    def _check_task(self, agent_id: str, task: str | None, who: str = "agent") -> None:
        """Keep ``agent_id`` out of the cohorts unless it declared the task this coordinator's run needs (``who``: what
        it is, as its line names it)."""
        if self.needs_task is None or task == self.needs_task or self._refusal_hint is not None:
            self._lacking.discard(agent_id)  # one-shot serve: an agent with another task was refused its Join
            return
        if agent_id not in self._lacking:
            self._lacking.add(agent_id)
            has = f"has task {task!r}" if task else "did not say which task it has (an older fedpar?)"
            self._on_lacking(agent_id, f"{who} {agent_id} is skipped: it {has}, this run needs {self.needs_task!r}")

    def _check_host_task(self, host_id: str, task: str | None) -> None:
        """Keep every member of simulation host ``host_id`` out of the cohorts unless it declared the run's task."""
        self._check_task(host_id, task, "simulation host")
        if host_id in self._lacking:
            self._lacking_hosts.add(host_id)
        else:
            self._lacking_hosts.discard(host_id)

    def declared_tasks(self) -> dict[str, str | None]:
        """The task each live agent declared at Join (None: it did not say); not a simulation host's members."""
        return {r.agent_id: (r.capabilities or {}).get("task") for r in self.registry.own_agents()}

    def join_population(self, host_id: str, host_token: str, member_ids: str, num_examples: Sequence[int],
                        away: Sequence[int] = (), peer: PeerIdentity | None = None, enrollment_token: str = "",
                        capabilities: dict[str, str] | None = None,
                        claim: SessionClaim = SessionClaim()) -> HostRecord:
        """A Refusal: this member source takes no simulated populations (server/populations.py does)."""
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      "this coordinator hosts no simulated populations; start it with --accept-populations")

    async def next_host_tasks(self, host: HostRecord, wait_seconds: float, away: Sequence[str],
                              back: Sequence[str], finish_estimates: Sequence[pb.FinishEstimate],
                              desk: TaskDesk, failures: Sequence[pb.TaskFailure] = (),
                              availability_at: float = -1.0) -> pb.PullHostTasksReply:
        """A Refusal: there are no simulation hosts here."""
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      "this coordinator hosts no simulated populations; start it with --accept-populations")

    def take_failures(self, host: HostRecord, failures: Sequence[pb.TaskFailure], desk: TaskDesk) -> None:
        """A Refusal: there are no simulation hosts here."""
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      "this coordinator hosts no simulated populations; start it with --accept-populations")

    def host_leaves(self, host: HostRecord) -> None:
        """Nothing: this member source holds no simulation hosts (server/populations.py does)."""

    def leave(self, agent_id: str) -> None:
        """The agent said goodbye: it is not sampled until it joins again."""
        self.registry.leave(agent_id)

    def _joined(self) -> None:
        self._forget_gone()
        self._changed.set()

    # ----------------------------------------------------------------- sampling
    def live_and_connected_ids(self) -> tuple[list[str], list[str]]:
        """(:meth:`live_ids`, every live member's id, those lacking the run's task too): one pass over the live
        members when none lacks the task."""
        connected = self.registry.live_ids()
        return (self.live_ids() if self._lacking else connected), connected

    def live_ids(self) -> list[str]:
        """Ids of the members that may be sampled now, sorted (not those lacking the run's task)."""
        live = self.registry.live_ids()
        if not self._lacking:
            return live
        if not self._lacking_hosts:
            return [a for a in live if a not in self._lacking]
        return [a for a in self.registry.live_ids_without(self._lacking_hosts) if a not in self._lacking]

    def live_count(self) -> int:
        """How many members may be sampled now (no pass over them unless some lack the run's task)."""
        return len(self.live_ids()) if self._lacking else len(self.registry.live_ids())

    async def changed(self, wait_seconds: float) -> None:
        """Until a member joins, leaves, goes away or comes back, or a host calls (at most ``wait_seconds``)."""
        self._changed.clear()
        await set_within(self._changed, wait_seconds)

    def hosts_heard(self, seconds: float) -> bool:
        """Whether every live simulation host has told who of its members is online at simulated time ``seconds``
        (agents that joined by themselves have no availability trace)."""
        return True

    async def wait_for_live(self, count: int, wait_seconds: float | None) -> None:
        """Until ``count`` members are live, or (``joined_count_as_available``: simulate's real clock with traces)
        have joined with at least one live: then the members a host reported offline by their availability traces are
        not waited for (a round samples the live ones). Woken as members join or come back; each half second a
        liveness may have run out. TimeoutError after ``wait_seconds`` (None: no limit)."""
        deadline = None if wait_seconds is None else time.monotonic() + wait_seconds
        least = 2 if self.config.secure_aggregation else 1  # a secure round's sum hides an update among others
        while (live := self.note_live()) < count:
            joined = live + self.registry.away_count() if self.config.joined_count_as_available else live
            if live >= least and joined >= count:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TooFewMembers(_too_few_online(live, joined, least, wait_seconds) if joined >= count else
                                    f"only {live} live agents after {wait_seconds}s; need min_available={count}")
            self._changed.clear()
            await set_within(self._changed, 0.5)

    def note_live(self) -> int:
        """:meth:`live_count`, kept in ``live_seen`` for other threads (a progress bar) to read."""
        self.live_seen = self.live_count()
        return self.live_seen

    # ----------------------------------------------------------------- tasks
    def poller(self, agent_id: str) -> str:
        """Whose long-poll hears of ``agent_id``'s tasks: the agent's own."""
        return agent_id

    def deal(self, agent_ids: Sequence[str]) -> None:
        """A task is waiting for each of ``agent_ids``: wake their long-polls."""
        for agent_id in agent_ids:
            self._wake(self.poller(agent_id))

    def let_go(self, agent_ids: Sequence[str]) -> None:
        """The clock let these members' held tasks go ahead (only simulation hosts hold tasks)."""

    def _wake(self, key: str) -> None:
        self._wakeups.setdefault(key, asyncio.Event()).set()

    async def wait(self, key: str, deadline: float) -> bool:
        """A long-poll's wait: until ``key`` (see :meth:`poller`) is woken or ``deadline`` (time.monotonic())
        passes; False if the time was up already."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        event = self._wakeups.setdefault(key, asyncio.Event())
        event.clear()
        await set_within(event, remaining)  # woken in one turn of the loop: its reply goes out at once
        return True

    @property
    def wakeups_held(self) -> int:
        """Long-poll wake-ups held (bounded by the members the registry holds)."""
        return len(self._wakeups)

    # ----------------------------------------------------------------- the end
    def finish(self, tell: bool) -> None:
        """Rounds are over: wake every long-poll; ``tell``: each live one must hear that training is over."""
        if tell:
            self._not_yet_told = self._live_pollers()
        self.wake_all()

    def wake_all(self) -> None:
        """Wake every long-poll (each looks again whether it has something to answer)."""
        for event in self._wakeups.values():
            event.set()

    def _live_pollers(self) -> set[str]:
        """The long-poll keys of the live agents."""
        return {r.agent_id for r in self.registry.own_agents()}

    def told(self, key: str) -> None:
        """The long-poller ``key`` heard that training is over."""
        self._not_yet_told.discard(key)

    def everyone_told(self) -> bool:
        """Whether every long-poller live at the end has heard that training is over."""
        return not self._not_yet_told

    def _forget_gone(self) -> None:
        """Drop the wake-ups of members the registry no longer holds (they expired), once there are twice as many
        as it holds: amortized O(1) per join, bounded by the live ones."""
        if len(self._wakeups) <= 2 * (len(self.registry) + self.registry.host_count) + 64:
            return
        self._wakeups = {k: e for k, e in self._wakeups.items() if self._known(k)}

    def _known(self, key: str) -> bool:
        return self.registry.get(key) is not None


class CohortSampler:
    """Samples M agents uniformly without replacement from the live ones."""

    def __init__(self, seed: int):
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def sample(self, live_ids: Sequence[str], size: int) -> list[str]:
        """``size`` distinct ids from ``live_ids``, which are sorted (all of them if there are fewer). Draws ``size``
        positions (numpy's Floyd sampling when the cohort is small beside the population) and reads only those: a
        cohort costs O(cohort log n) from the registry's live ids, not a pass over the population."""
        if size >= len(live_ids):
            return list(live_ids)
        picked = np.sort(self._rng.choice(len(live_ids), size=size, replace=False))
        if isinstance(live_ids, LiveIds):
            return live_ids.take(picked)  # every position found at once: O(cohort log n)
        return [live_ids[int(i)] for i in picked]

    def state(self) -> dict:
        """The RNG state as JSON-able data."""
        return self._rng.bit_generator.state

    def load_state(self, state: dict) -> None:
        """Restore an RNG state saved by :meth:`state`."""
        if not isinstance(state, dict) or state.get("bit_generator") != "PCG64":
            raise ValueError("sampler state must be a PCG64 state dict")
        self._rng.bit_generator.state = state
