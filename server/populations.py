"""The member source of simulated federations (``--accept-populations``): simulation hosts, each speaking for a slice
of a virtual population, beside agents that joined by themselves (none under the virtual clock).

A host joins its members (JoinPopulation), long-polls for all of their tasks at once (on its HostTaskStream), reports
which went offline or came back, and, under the virtual clock, each sampled member's simulated finish time; its members
upload with their own sessions. The coordinator deals tasks and lets held ones go through :class:`Populations`
alone (server/members.py says how).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import REPEATED_ENTRY_BYTES, entries_within
from fedpar.security.admission import AdmissionRefused, PeerIdentity
from fedpar.server.config import CoordinatorConfig
from fedpar.server.members import Members, TaskDesk
from fedpar.server.registry import (AgentRecord, AgentRegistry, AuthError, HostRecord, SessionClaim, SessionInUse,
                                    check_capabilities)
from fedpar.server.rounds import Refusal, RoundState

log = logging.getLogger("fedpar.server")
HOST_WAKEUP = "\0host:"  # long-poll key prefix of a simulation host (agent ids are printable, so never clash)
# one-shot serve waits this long after a host joined for agents that join by themselves to make up a population smaller
# than --min-available, before it refuses the host (its rounds would never start: the worker hung in silence)
MAX_HOSTED_TASKS = 512  # tasks in one PullHostTasksReply (a reply also stays within --max-chunk-bytes)


class Populations(Members):
    """Simulation hosts and their members (and agents that joined by themselves, unless ``hosts_only``)."""

    def __init__(self, config: CoordinatorConfig, registry: AgentRegistry, hosts_only: bool = False):
        super().__init__(config, registry)
        self.hosts_only = hosts_only
        self._host_tasks: dict[str, set[str]] = {}  # per host: its members dealt a task not yet sent
        self._host_carried: dict[str, pb.HostedTask] = {}  # per host: a task made for a reply it did not fit
        self._host_declared: dict[str, str | None] = {}  # per host: the task it declared when it joined
        self._host_go: dict[str, set[str]] = {}  # per host: its members the clock let go, not yet told
        self._heard_at: dict[str, float] = {}  # per host: the simulated time its last call's availability was as of
        self._population_said: set[str] = set()  # hosts whose population was said to be short of --min-available

    def join(self, agent_id: str, num_examples: int, capabilities: dict[str, str],
             peer: PeerIdentity | None = None, enrollment_token: str = "",
             claim: SessionClaim = SessionClaim()) -> AgentRecord:
        """Register an agent (a Refusal under the virtual clock: only simulation hosts report finish times)."""
        if self.hosts_only:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "this coordinator runs a virtual clock (--clock virtual): only simulation hosts take part")
        return super().join(agent_id, num_examples, capabilities, peer, enrollment_token, claim)

    def join_population(self, host_id: str, host_token: str, member_ids: str, num_examples: Sequence[int],
                        away: Sequence[int] = (), peer: PeerIdentity | None = None, enrollment_token: str = "",
                        capabilities: dict[str, str] | None = None,
                        claim: SessionClaim = SessionClaim()) -> HostRecord:
        """Register (more of) a simulation host's members as JoinPopulation carries them (server/registry.py), which a
        service's run samples only if the host's ``capabilities`` declare the run's task; a Refusal on bad data, and
        ALREADY_EXISTS when another live process holds the host's session (``claim``: who asks,
        server/registry.py). A process started again under the host's id is told to the coordinator
        (:attr:`on_restart`)."""
        if len(num_examples) > self.config.max_population_join:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{len(num_examples)} members in one JoinPopulation; send at most "
                          f"{self.config.max_population_join} per call")
        capabilities = capabilities or {}
        replaced = self.registry.host(host_id)
        try:
            check_capabilities(capabilities)
            population = declared_population(capabilities.get("population"))  # before the host is registered
            host = self.registry.join_population(host_id, host_token, member_ids, num_examples, away, peer,
                                                 enrollment_token, self.config.max_examples_per_agent,
                                                 claim)
        except ValueError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except AuthError as exc:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        except SessionInUse as exc:  # said here too: the operator sees why a launch went away
            log.warning("refused a second process for simulation host %r from %s: %s", host_id, claim.address or "?",
                        exc)
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS, str(exc), trailing=exc.refusal_trailing()) from None
        except AdmissionRefused as exc:
            raise Refusal(exc.code, exc.message) from None
        self._host_tasks.setdefault(host_id, set())
        if replaced is not None and replaced is not host:  # the old session's long-poll ends now, taking no tasks
            self._wake(HOST_WAKEUP + host_id)
        self._host_declared[host_id] = capabilities.get("task")
        if self._refused(host_id, capabilities.get("task"), "simulation host"):  # admitted first, as an agent
            self._lacking_hosts.add(host_id)  # none of its members is sampled
            self.registry.calls_cut(host)  # the process started again with the run's task may take its place at once
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          self._other_task(host_id, capabilities.get("task"), "simulation host"))
        self._check_host_task(host_id, capabilities.get("task"))
        self._note_population(host, population)
        self._joined()
        if not host_token and self.registry.another_process(replaced, claim):  # the first call of a new process
            self.on_restart("host", host_id)
        return host

    def _note_population(self, host: HostRecord, population: int | None) -> None:
        """Say once when one-shot serve waits for more agents (--min-available) than the whole population ``host``
        declared a slice of (its "population" capability: a launch's hosts each declare the whole)."""
        if population is None:
            return
        needed = self.config.min_available
        if population < needed and self._refusal_hint is not None and host.host_id not in self._population_said:
            # said (serve shows info lines), not refused nor warned: agents joining by themselves may make up the rest
            self._population_said.add(host.host_id)
            log.info("simulation host %s hosts a slice of a population of %d clients (simulate-workers --clients %d), "
                     "and this run waits for %d (serve --min-available %d): its rounds start only once agents or other "
                     "hosts make up the other %d; start both with the same number if this is the whole population",
                     host.host_id, population, population, needed, needed, needed - population)

    def host_leaves(self, host: HostRecord) -> None:
        """``host``'s process said it is leaving (Leave): it and its members are forgotten now, so an open round stops
        waiting for those it sampled (the coordinator counts them lost) and none is sampled until it joins again."""
        if self._forget_host(host):
            log.info("simulation host %s left, with its %d members", host.host_id, host.members)

    def _forget_host(self, host: HostRecord) -> bool:
        """Forget ``host`` and its members now; whether it was still held."""
        if self.registry.host(host.host_id) is not host:
            return False
        self.registry.forget_host(host.host_id)
        self._wake(HOST_WAKEUP + host.host_id)
        self._changed.set()
        return True

    def _check_joined(self) -> None:
        """As for agents, and for each simulation host still known, by the task it declared at JoinPopulation."""
        super()._check_joined()
        for host_id, task in sorted(self._host_declared.items()):
            if self.registry.host(host_id) is not None:
                self._check_host_task(host_id, task)

    def declared_tasks(self) -> dict[str, str | None]:
        """The task each live agent, and each simulation host still known, declared when it joined."""
        hosts = {h: task for h, task in self._host_declared.items() if self.registry.host(h) is not None}
        return {**super().declared_tasks(), **hosts}

    def poller(self, agent_id: str) -> str:
        """Whose long-poll hears of ``agent_id``'s tasks: its host's (HOST_WAKEUP + the host), or its own."""
        record = self.registry.get(agent_id)
        return HOST_WAKEUP + record.host if record is not None and record.host is not None else agent_id

    def deal(self, agent_ids: Sequence[str]) -> None:
        """A task is waiting for each of ``agent_ids``: queue it for its host, if it has one, and wake the long-poll
        (the members' records are looked up together: one pass over the member table)."""
        for agent_id, record in zip(agent_ids, self.registry.get_many(agent_ids)):
            if record is None or record.host is None:
                super().deal([agent_id])
                continue
            self._host_tasks.setdefault(record.host, set()).add(agent_id)
            self._wake(HOST_WAKEUP + record.host)

    def let_go(self, agent_ids: Sequence[str]) -> None:
        """Tell the hosts of ``agent_ids`` that their held tasks may go ahead."""
        for agent_id, record in zip(agent_ids, self.registry.get_many(agent_ids)):
            if record is not None and record.host is not None:
                self._host_go.setdefault(record.host, set()).add(agent_id)
                self._wake(HOST_WAKEUP + record.host)

    async def next_host_tasks(self, host: HostRecord, wait_seconds: float, away: Sequence[str],
                              back: Sequence[str], finish_estimates: Sequence[pb.FinishEstimate],
                              desk: TaskDesk, failures: Sequence[pb.TaskFailure] = (),
                              availability_at: float = -1.0) -> pb.PullHostTasksReply:
        """The tasks of ``host``'s members sampled since its last call (and those the clock let go), waiting up to
        ``wait_seconds`` for some; ``away`` / ``back``: its members that went offline or came back (not sampled
        while away); ``finish_estimates``: its members' simulated finish times for their held tasks;
        ``failures``: its members whose own code failed their task; ``availability_at``: the simulated time
        ``away`` and ``back`` are as of (server/virtual_clock.py waits for every host's at its time)."""
        if away or back:
            self.registry.set_away(host.host_id, list(away), list(back))
        self._heard_at[host.host_id] = availability_at
        self._changed.set()  # the virtual clock waits for every host to have told where it stands
        for estimate in finish_estimates:
            self._check_member(host, estimate.agent_id)
            desk.clock.record(desk.current, estimate.agent_id, estimate.task_id, estimate.seconds)
        self.take_failures(host, failures, desk)
        key = HOST_WAKEUP + host.host_id
        steps = desk.clock.idle_steps  # the clock moving on between rounds ends the wait: the host hears the time
        deadline = time.monotonic() + max(0.0, min(wait_seconds, self.config.heartbeat_seconds))
        while True:
            if self.registry.host(host.host_id) is not host:  # a new session: its own long-polls take the tasks
                raise Refusal(grpc.StatusCode.UNAUTHENTICATED, f"host {host.host_id!r}'s session was replaced or "
                                                               "expired: call JoinPopulation again")
            if desk.finished and not desk.keeps_members:
                self.told(key)
                return pb.PullHostTasksReply(shutdown_reason=desk.finished_reason())
            out = self._reply(host.host_id, desk)
            if out.tasks or out.go or desk.handed_over or desk.clock.idle_steps != steps \
                    or not await self.wait(key, deadline):
                return out
            host.last_seen = time.monotonic()

    def take_failures(self, host: HostRecord, failures: Sequence[pb.TaskFailure], desk: TaskDesk) -> None:
        """``host``'s members whose own code failed their task (a Refusal naming one that is not its member): the
        round waits for them no longer."""
        for failure in failures:
            self._check_member(host, failure.agent_id)
            desk.task_failed(failure.agent_id, failure.task_id, failure.reason)

    def hosts_heard(self, seconds: float) -> bool:
        """Whether every live simulation host has told who of its members is online at simulated time ``seconds``."""
        return all(self._heard_at.get(h, -1.0) >= seconds for h in self.registry.live_hosts())

    def _check_member(self, host: HostRecord, agent_id: str) -> None:
        """A Refusal unless ``agent_id`` is a member of ``host``."""
        record = self.registry.get(agent_id)
        if record is None or record.host != host.host_id:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, f"{agent_id[:128]!r} is not a member of host "
                                                             f"{host.host_id!r}")

    def _reply(self, host_id: str, desk: TaskDesk) -> pb.PullHostTasksReply:
        """The tasks and go-aheads waiting for ``host_id``, with one copy of a small model for the whole reply: at
        most MAX_HOSTED_TASKS tasks and --max-chunk-bytes in all, as the reply travels as one gRPC message (a
        Flower message rides in each member's task); the next call takes the rest."""
        pending = sorted(self._host_tasks.get(host_id, ()))
        out = pb.PullHostTasksReply()
        go = sorted(self._host_go.pop(host_id, ()))
        told = entries_within(go, self.config.max_chunk_bytes // 2)  # half for the go-aheads, the rest next reply
        if told < len(go):
            self._host_go[host_id] = set(go[told:])
        out.go.extend(go[:told])
        desk.clock.stamp_reply(out)
        room = self.config.max_chunk_bytes - out.ByteSize()
        inline = desk.inline_weights()
        inline_bytes = len(inline[0]) + len(inline[1]) + 2 * REPEATED_ENTRY_BYTES if inline is not None else 0
        if inline_bytes and inline_bytes <= room // 2:
            room -= inline_bytes  # the model once, beside the tasks
        else:
            inline = None  # too big to share the reply: each member's task downloads it
        carried = self._host_carried.pop(host_id, None)  # made already (a task is handed out once): it goes first
        if carried is not None and _still_due(carried, desk.current):
            out.tasks.append(carried)
            room -= carried.ByteSize() + REPEATED_ENTRY_BYTES
        batch = pending[:MAX_HOSTED_TASKS]
        taken = len(batch)
        for i, (agent_id, record) in enumerate(zip(batch, self.registry.get_many(batch))):  # one pass of records
            reply = desk.task_for(record, with_weights=False) if record is not None and record.host == host_id \
                else None
            if reply is None or reply.WhichOneof("kind") != "task":
                continue
            hosted = out.tasks.add(agent_id=agent_id)
            hosted.task.MergeFrom(reply.task)
            size = hosted.ByteSize() + REPEATED_ENTRY_BYTES
            if size > room and len(out.tasks) > 1:  # the first task always goes: the Grid bounds one message
                self._host_carried[host_id] = pb.HostedTask()
                self._host_carried[host_id].CopyFrom(hosted)
                del out.tasks[-1]
                taken = i + 1
                break
            room -= size
        self._host_tasks[host_id] = set(pending[taken:])
        if inline is not None and out.tasks and not out.tasks[0].task.flower_message:
            out.weights_header.MergeFromString(inline[0])
            out.weights = inline[1]
        return out

    def _live_pollers(self) -> set[str]:
        """The long-poll keys of the live agents and of the live hosts (which speak for their members)."""
        return super()._live_pollers() | {HOST_WAKEUP + h for h in self.registry.live_hosts()}

    def _forget_gone(self) -> None:
        """As for agents, and the queues of hosts the registry no longer holds."""
        if len(self._wakeups) + len(self._host_tasks) <= 2 * (len(self.registry) + self.registry.host_count) + 64:
            return
        self._wakeups = {k: e for k, e in self._wakeups.items() if self._known(k)}
        self._host_tasks = {h: q for h, q in self._host_tasks.items() if self.registry.host(h) is not None}
        self._host_go = {h: q for h, q in self._host_go.items() if self.registry.host(h) is not None}
        self._host_carried = {h: t for h, t in self._host_carried.items() if self.registry.host(h) is not None}
        self._heard_at = {h: t for h, t in self._heard_at.items() if self.registry.host(h) is not None}

    def _known(self, key: str) -> bool:
        if key.startswith(HOST_WAKEUP):
            return self.registry.host(key[len(HOST_WAKEUP):]) is not None
        return super()._known(key)


def _still_due(hosted: pb.HostedTask, state: RoundState | None) -> bool:
    """Whether ``hosted``, a task made for a member earlier, is still its task in the open round ``state``."""
    slot = state.slots.get(hosted.agent_id) if state is not None and not state.closed else None
    return slot is not None and state.round_id == hosted.task.round and slot.task_id == hosted.task.task_id \
        and slot.status == "pending"


def member_source(config: CoordinatorConfig, registry: AgentRegistry) -> Members:
    """The member source ``config`` asks for: agents that joined, plus simulation hosts with --accept-populations
    (hosts only under the virtual clock)."""
    if config.accept_populations:
        return Populations(config, registry, hosts_only=config.virtual_clock)
    return Members(config, registry)


def declared_population(declared: str | None) -> int | None:
    """The whole population a host's "population" capability declares (None: it declares none); ValueError for a
    value that is not a count of clients."""
    if declared is None:
        return None
    if not (declared.isascii() and declared.isdigit() and 0 < int(declared) <= 10 ** 12):
        raise ValueError(f"capability 'population' must be a count of clients, not {declared[:40]!r}")
    return int(declared)
