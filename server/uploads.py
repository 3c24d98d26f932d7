"""The upload intake: the one way an update enters a round, whichever transport carried it.

An authenticated agent's upload passes, in this order: the agent's calls in flight (server/limits.py) -> a place
in the upload queue (:meth:`UploadIntake.upload_queue`) -> its ticket against the open round (:func:`open_ticket`:
round, slot, duplicates, weight and report, layout) -> its attempts this round (server/limits.py) -> a staging slot
(each staged upload holds one model copy) -> its bytes land in a staging buffer (:meth:`Upload.write`: the chunk
count, the agent's byte rate, the pace; a SmallUpload's size: :meth:`UploadIntake.small_receiver`) -> complete and
finite -> the round's mode decodes, counts and folds it (:meth:`Upload.accept`) -> settled: a final refusal rejects
the update, any other end leaves the agent free to try again. Per-update work runs on the loop for small updates,
on a thread for large ones (:func:`per_update`). gRPC (server/app.py) runs all of it on the coordinator's event loop
through :meth:`UploadIntake.take`. The data plane (server/dataplane.py) moves bytes and scans them in its
worker threads and runs :meth:`UploadIntake.open`, :meth:`Upload.accept` and :meth:`UploadIntake.settle`
on the loop. Every state change happens on the loop.

Staging slots are earned by progress: each staged upload holds one model copy, so their number is bounded
(--max-concurrent-uploads), and an upload keeps its slot only while it keeps pace.

An upload that falls silent for --upload-idle-seconds, or whose average rate falls below
--upload-min-bytes-per-second once RATE_GRACE_SECONDS have passed, is refused (:class:`UploadPace`). While other
uploads wait for a slot, the bar is higher (:meth:`UploadPace.behind`): a holder whose bytes so far came slower
than the minimum rate, or that is behind it and silent for QUIET_SECONDS, gives its slot to the first waiter at
once. An agent whose upload lost its slot that way waits behind everyone else for its next one in the round, and
while waiting takes no slot from anyone (:class:`StagingSlots`), so slow honest agents cannot take turns
overtaking each other: each is overtaken at most once a round by an upload that was not. Both transports use
them; all slot state changes on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from concurrent.futures import Executor
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Iterator, NoReturn

import grpc
import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import (NO_RUN_IN_PROGRESS, SMALL_UPDATE_BYTES, CodecError, ModelLayout, ModelTooLarge,
                                   TensorAssembler, check_report, layout_from_pb, specs_match)
from fedpar.server.config import CoordinatorConfig
from fedpar.server.limits import Limits
from fedpar.server.registry import AgentRecord
from fedpar.server.rounds import AgentSlot, Refusal, RoundState, UploadTicket, not_this_round

RATE_GRACE_SECONDS = 2.0  # with no one waiting, an upload's average rate counts from this long after its slot
QUIET_SECONDS = 1.0  # with uploads waiting, a holder behind the minimum rate may fall silent this long at most
WAITER_POLL_SECONDS = 0.05  # how often a waiting upload looks for a holder that fell behind


class UploadPace:
    """Whether a staged upload still earns its staging slot.

    It must not fall silent for ``idle_seconds``, and from RATE_GRACE_SECONDS on (or ``idle_seconds`` if shorter)
    its average rate must stay at least ``min_bytes_per_second``; either failure refuses it (not final: the agent
    may try again), so an upload trickling bytes holds a slot for seconds, not until the idle limit or the round's
    deadline. Each chunk may take ``idle_seconds`` plus its size at the minimum rate, so an honest upload on a link
    at least that fast is never refused. Both transports keep one per staged upload; :meth:`note` and the wait
    methods run on the upload's own thread or task, :meth:`behind` on the loop.
    """

    def __init__(self, idle_seconds: float, min_bytes_per_second: float, deadline_at: float, total_bytes: int):
        self.idle, self.min_rate, self.deadline_at = idle_seconds, min_bytes_per_second, deadline_at
        self.total = total_bytes
        self.grace = min(idle_seconds, RATE_GRACE_SECONDS)
        self.started = time.monotonic()
        self.last_at: float | None = None  # when its latest bytes came (None: none since the slot)
        self.received = 0
        self.preempted = False  # set (loop) when its slot went to a waiting upload

    def restart(self) -> None:
        """Start the clock: the upload holds a staging slot from now on."""
        self.started, self.last_at, self.received = time.monotonic(), None, 0

    def next_wait(self, nbytes: int = 0) -> float:
        """Seconds the next ``nbytes`` may take to arrive: the idle limit (plus their time at the minimum rate),
        or less when the round's deadline is nearer."""
        allowed = self.idle + (nbytes / self.min_rate if self.min_rate else 0.0)
        return max(0.0, min(allowed, self.deadline_at - time.monotonic()))

    def stalled(self) -> Refusal:
        """The refusal for an upload whose next bytes did not come in :meth:`next_wait` (or that lost its slot)."""
        if self.preempted:
            return self.overtaken()
        if time.monotonic() >= self.deadline_at - 0.01:
            return Refusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                           "no upload data arrived before the round's deadline; the update was not applied")
        return Refusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"the upload stalled after {self.received} bytes (no progress for {self.idle:g} s, "
                       "--upload-idle-seconds); its staging slot went to others and the update was not applied: "
                       "send it again")

    def overtaken(self) -> Refusal:
        """The refusal for an upload whose slot went to a waiting one because it fell behind."""
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the upload fell behind --upload-min-bytes-per-second {self.min_rate:.0f} ({self.received} "
                       f"bytes in {time.monotonic() - self.started:.1f} s) while other uploads waited; its staging "
                       "slot went to them and the update was not applied: send it again")

    def note(self, nbytes: int) -> None:
        """Count ``nbytes`` arrived; a Refusal if the upload lost its slot or became slower than the minimum rate."""
        now = time.monotonic()
        if self.preempted:
            raise self.overtaken()
        self.last_at = now
        self.received += nbytes
        elapsed = now - self.started
        if elapsed > self.grace and self.received < min(self.total, self.min_rate * elapsed):
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the upload is too slow ({self.received / elapsed:.0f} bytes/s over {elapsed:.0f} s, "
                          f"below --upload-min-bytes-per-second {self.min_rate:.0f}); its staging slot went to "
                          "others and the update was not applied: send it again")

    def behind(self, now: float, on_notice: bool = False) -> bool:
        """Whether, with uploads waiting for its slot, it should give the slot up (loop): its bytes so far came
        slower than the minimum rate, or it is behind that rate and silent for QUIET_SECONDS (an agent's round
        trip plus a chunk). ``on_notice``: it lost a slot this round already, so any silence is too long."""
        if self.received >= self.total:
            return False  # all staged: it is being checked or folded
        if self.last_at is not None and self.received < self.min_rate * (self.last_at - self.started):
            return True
        quiet = now - (self.started if self.last_at is None else self.last_at)
        return (on_notice or quiet >= QUIET_SECONDS) and self.received < self.min_rate * (now - self.started)


class SlotHold:
    """One upload's claim on a staging slot: its pace, and how to stop it when the slot is taken back."""

    def __init__(self, key: tuple, pace: UploadPace, interrupt: Callable[[], None]):
        self.key, self.pace, self.interrupt = key, pace, interrupt
        self.released = False


class StagingSlots:
    """``count`` staging slots: granted in arrival order, except that agents whose upload was overtaken this round
    wait behind the rest; while uploads wait, a holder that fell behind (:meth:`UploadPace.behind`) is overtaken."""

    def __init__(self, count: int):
        self.free = count
        self.holders: list[SlotHold] = []
        self.waiting: deque[tuple[bool, asyncio.Future]] = deque()  # (overtaken before, granted when done)
        self.overtaken: set[tuple] = set()  # (agent, round) keys whose upload lost its slot
        self.overtakes = 0

    async def acquire(self, key: tuple, pace: UploadPace, interrupt: Callable[[], None],
                      seconds: float | None = None) -> SlotHold:
        """Wait for a slot for the upload ``key`` = (agent id, round id) (loop); TimeoutError after ``seconds``.
        ``interrupt()`` is called (loop) if the slot is taken back, to stop the upload's wait for its bytes."""
        self.overtaken = {k for k in self.overtaken if k[1] == key[1]}  # only this round's count
        if self.free and not self.waiting:
            self.free -= 1
        else:
            await self._wait(key in self.overtaken, seconds)
        hold = SlotHold(key, pace, interrupt)
        self.holders.append(hold)
        return hold

    async def _wait(self, on_notice: bool, seconds: float | None) -> None:
        loop = asyncio.get_running_loop()
        until = None if seconds is None else loop.time() + seconds
        granted = loop.create_future()
        entry = (on_notice, granted)
        self.waiting.append(entry)
        try:
            while not granted.done():
                if not on_notice:  # one overtaken this round takes no slot from anyone
                    self._overtake_one()
                wait = WAITER_POLL_SECONDS if until is None else min(WAITER_POLL_SECONDS, until - loop.time())
                if wait <= 0:
                    raise TimeoutError("no staging slot became free in time")
                await asyncio.wait((granted,), timeout=wait)
        except BaseException:
            if granted.done() and not granted.cancelled():
                self._pass_on()  # granted as it gave up: the slot goes to the next
            else:
                granted.cancel()
                self.waiting.remove(entry)
            raise

    def _overtake_one(self) -> None:
        """Take a slot back from one holder that fell behind, if one did, for the first waiter."""
        now = time.monotonic()
        for hold in self.holders:
            if hold.pace.behind(now, on_notice=hold.key in self.overtaken):
                hold.pace.preempted = True
                self.overtaken.add(hold.key)
                self.overtakes += 1
                self.release(hold)
                hold.interrupt()
                return

    def release(self, hold: SlotHold) -> None:
        """Give the slot back (loop); a slot already taken back is not given twice."""
        if hold.released:
            return
        hold.released = True
        self.holders.remove(hold)
        self._pass_on()

    def _pass_on(self) -> None:
        """A slot fell free: to the first waiter that was not overtaken this round, else the first, else free."""
        if not self.waiting:
            self.free += 1
            return
        entry = next((e for e in self.waiting if not e[0]), self.waiting[0])
        self.waiting.remove(entry)
        entry[1].set_result(None)


def open_round(plane, round_id: int, what: str, *agent_ids: str):
    """The open round of ``plane`` if ``round_id`` is it, else a Refusal saying which round is current (or that no
    run is, on a service's coordinator between runs); the updates of ``agent_ids`` for it, closed, count as late."""
    state = plane.current
    if not plane.runs_rounds:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"{what} for round {round_id}, but {NO_RUN_IN_PROGRESS} on this service: the run it was for "
                      "ended (it finished or was stopped); the update was not applied")
    if state is None or round_id != state.round_id:
        raise not_this_round(what, round_id, plane.current_round_id)
    if state.closed:
        state.refuse_if_closed(*[slot for agent_id in agent_ids
                                 if (slot := state.slots.get(agent_id)) is not None and slot.status == "pending"])
    state.check_open()
    return state


def slot_to_fill(state, agent_id: str, task_id: str, rank: int, admit=None):
    """``agent_id``'s slot in ``state`` for ``task_id`` if it uploads at ``rank``, passes ``admit`` (the round
    mode's) and has sent nothing yet; else a Refusal (a slot sent to twice: ALREADY_EXISTS)."""
    slot = state.slot_for(agent_id, task_id)
    if slot.rank != rank:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"{agent_id!r} uploads to aggregator rank {slot.rank} this round (its task says where), not to "
                      f"rank {rank}; the update was not applied")
    if admit is not None:
        admit(agent_id)
    if slot.status in ("uploading", "accepted", "rejected"):
        raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                      f"{agent_id!r} already sent an update in round {state.round_id} ({slot.status}); "
                      "duplicates are refused")
    return slot


def open_ticket(plane, agent: AgentRecord, header: pb.UploadHeader) -> UploadTicket:
    """Validate ``agent``'s upload header against the open round of ``plane`` (an aggregator rank's IngestPlane,
    server/ranks/plane.py); its ticket, or a Refusal saying what is wrong (the slot is marked uploading only when
    every check passed)."""
    mode, config = plane.mode, plane.config
    state = open_round(plane, header.round, "upload", agent.agent_id)
    slot = slot_to_fill(state, agent.agent_id, header.task_id, plane.rank, mode.admit)
    metrics = dict(header.metrics)
    try:  # Join made num_examples >= 1
        check_report(header.num_examples, agent.num_examples, config.local_epochs, header.steps, metrics)
    except ValueError as exc:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    expected, described = mode.expected_layout(header)
    if not specs_match(header.tensors, expected):
        _refuse_tensors(header, config, expected, described)
    if header.total_bytes != expected.total_bytes:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"total_bytes={header.total_bytes} but the tensors need {expected.total_bytes}")
    slot.status, slot.upload_bytes = "uploading", expected.total_bytes
    return UploadTicket(state, slot, int(header.num_examples), metrics, expected, mode)


@dataclass
class CheckedPartial:
    """A population host's pre-summed update that passed every check: its members' slots and (examples, metrics)
    reports, their total weight and the finite weighted mean of their new weights."""

    state: RoundState
    slots: list[AgentSlot]
    reports: list[tuple[int, dict[str, float]]]
    total_weight: int
    arrays: list[np.ndarray]


def check_partial(plane, host_id: str, partial: pb.HostPartial) -> CheckedPartial:
    """Check ``host_id``'s pre-summed update against the open round of ``plane`` (loop): each member its host's,
    sampled this round with this task at this rank, not counted yet, its weight, steps and metrics as an upload's
    (:func:`check_report`), the arrays' lengths matching, the data the model's layout and finite. A Refusal names
    the first problem and leaves every slot as it was; on success the members' slots are marked uploading."""
    config, registry = plane.config, plane.registry
    ids = partial.member_ids.split("\n") if partial.member_ids else []
    # its own members' updates, once closed, count as late (as one by one): another host's are not its to count
    own = [member for member, (member_host, _) in zip(ids, registry.member_hosts(ids)) if member_host == host_id] \
        if plane.current is not None and plane.current.closed else []
    state = open_round(plane, partial.round, "partial", *own)
    tasks = partial.task_ids.split("\n") if partial.task_ids else []
    names, values = list(partial.metric_names), np.asarray(partial.metric_values, dtype=np.float64)
    if not ids or not len(ids) == len(tasks) == len(partial.num_examples) == len(partial.steps) \
            or values.size != len(ids) * len(names):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"a partial's member arrays must be as long as its {len(ids)} member ids (task ids "
                      f"{len(tasks)}, num_examples {len(partial.num_examples)}, steps {len(partial.steps)}, "
                      f"metric values {values.size} = members x {len(names)} names); the update was not applied")
    if len(set(ids)) != len(ids) or len(set(names)) != len(names):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "a partial names a member (or a metric) twice; each member's "
                                                        "update counts once")
    if state.accepted + len(ids) > state.target:  # first-K counts updates one by one: those past K are late
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"round {state.round_id} closes after {state.target - state.accepted} more updates, fewer than "
                      f"the partial's {len(ids)}; send them one by one")
    rows = values.reshape(len(ids), len(names))
    slots, reports = [], []
    hosts = registry.member_hosts(ids)
    for member, (member_host, registered), task_id, examples, steps, row in zip(ids, hosts, tasks,
                                                                                 partial.num_examples, partial.steps,
                                                                                 rows):
        if member_host != host_id:  # (another rank than 0 holds sessions of the members dealt to it only)
            where = f"dealt to aggregator rank {plane.rank}" if member_host is None and plane.rank \
                else f"a member of host {host_id!r}"
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                          f"{member[:64]!r} is not {where}; the partial was not applied")
        slot = slot_to_fill(state, member, task_id, plane.rank)
        metrics = dict(zip(names, row.tolist()))
        try:
            check_report(examples, registered, config.local_epochs, steps, metrics)
        except ValueError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"member {member!r}: {exc}; the partial was not applied") from None
        slots.append(slot)
        reports.append((int(examples), metrics))
    expected = plane.mode.layout
    if not specs_match(partial.tensors, expected) or partial.total_bytes != expected.total_bytes \
            or len(partial.data) != expected.total_bytes:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"a partial must carry the global model's tensors ({expected.total_bytes} bytes); "
                      f"it carries {len(partial.data)} bytes, total_bytes={partial.total_bytes}")
    staging = TensorAssembler(expected, max(expected.total_bytes, 1))
    staging.write(0, partial.data)
    bad = staging.first_non_finite()
    if bad is not None:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"tensor {bad!r} of the partial contains NaN or Inf; the partial was not applied")
    for slot in slots:  # a round's upload_bytes counts each member's update, as if it had come on its own
        slot.status, slot.upload_bytes = "uploading", expected.total_bytes
    return CheckedPartial(state, slots, reports, sum(n for n, _ in reports), staging.arrays)


def _refuse_tensors(header: pb.UploadHeader, config: CoordinatorConfig, expected: ModelLayout,
                    described: str) -> NoReturn:
    """Refuse a header whose tensors are not ``expected``'s, saying what is wrong with them."""
    try:
        layout = layout_from_pb(header.tensors, config.max_model_bytes)
    except ModelTooLarge as exc:
        raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tensor header refused: {exc} (--max-model-bytes); "
                      "the update was not applied") from None
    except CodecError as exc:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"bad tensor header: {exc}") from None
    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                  f"update does not match {described}: {layout.mismatch(expected) or 'its tensors differ'}")


async def in_thread(executor: Executor | None, fn, *args):
    """``fn(*args)`` on a thread of ``executor`` (None: the loop's default one)."""
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


async def per_update(nbytes: int, fn, *args, executor: Executor | None = None):
    """``fn(*args)`` for one update of ``nbytes``: on the loop when small, else on a thread of ``executor``."""
    if nbytes <= SMALL_UPDATE_BYTES:  # per-update work (NaN/Inf scan, decoding, folding) stays on the loop
        return fn(*args)
    return await in_thread(executor, fn, *args)


def update_runner(nbytes: int, executor: Executor):
    """:func:`per_update` for the updates of a model of ``nbytes``, on ``executor``'s threads."""
    return functools.partial(per_update, nbytes, executor=executor)


class Upload:
    """One admitted upload: its ticket, the limits it holds until settled, and its staging buffer."""

    def __init__(self, intake: UploadIntake, agent_id: str, ticket: UploadTicket, held: ExitStack):
        self.intake = intake
        self.agent_id = agent_id
        self.ticket = ticket
        self.held = held
        self.prepaid = 0  # upload bytes charged to the agent's rate before they arrived
        self._staging: TensorAssembler | None = None
        config, state = intake.coord.config, ticket.state
        self.pace = UploadPace(config.upload_idle_seconds, config.upload_min_bytes_per_second,
                               state.closes_at, ticket.layout.total_bytes)
        self.overtaken: asyncio.Future | None = None  # on gRPC: done when its staging slot is taken back

    @property
    def staging(self) -> TensorAssembler:
        """The staging buffer (one copy of the upload), allocated on first use: after a staging slot is held."""
        if self._staging is None:
            self._staging = TensorAssembler(self.ticket.layout, self.intake.max_chunk_bytes)
        return self._staging

    @property
    def round_id(self) -> int:
        """The round the upload is for."""
        return self.ticket.state.round_id

    def write(self, offset: int, data: bytes) -> None:
        """Stage one chunk: counted against the chunk limit, the agent's byte rate and the upload's pace; a bad
        chunk is final."""
        max_chunks = self.intake.coord.config.max_upload_chunks
        if self.staging.chunks >= max_chunks:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"upload has more than {max_chunks} chunks "
                          "(--max-upload-chunks); send larger chunks. The update was not applied")
        try:
            self.staging.write(offset, data)
        except CodecError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{exc}; the update was not applied", final=True) from None
        self.intake.limits.count_bytes(self.agent_id, len(data))
        self.pace.note(len(data))

    def finite_arrays(self) -> list[np.ndarray]:
        """The complete staged arrays, or a final Refusal if any holds NaN or Inf (any thread)."""
        bad = self.staging.first_non_finite()
        if bad is not None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {bad!r} contains NaN or Inf; update refused",
                          final=True)
        return self.staging.arrays

    async def checked_arrays(self) -> list[np.ndarray]:
        """:meth:`finite_arrays`, scanned on the loop for small updates and on a worker thread for large ones."""
        return await per_update(self.staging.layout.total_bytes, self.finite_arrays)

    async def accept(self, arrays: list[np.ndarray]) -> pb.UploadReply:
        """Hand the complete, finite update to the round's mode to count and fold (loop; a Refusal if its content is
        invalid or the round closed meanwhile); the reply to send on success."""
        ticket = self.ticket
        state, mode = ticket.state, ticket.mode
        await state.ready_to_count()
        arrays = await mode.decoded(self.intake.coord.weights, arrays)  # refused here if the content is invalid
        state.refuse_if_closed(ticket.slot)
        if state.on_count is not None:
            await state.on_count(state, [ticket.slot], [(ticket.num_examples, ticket.metrics)])
        await mode.accept(state, ticket, arrays)
        return pb.UploadReply(accepted=True, message=f"update accepted for round {self.round_id}")


class UploadIntake:
    """Admits, stages, checks and settles every upload (the gRPC service's and the data plane's)."""

    def __init__(self, coordinator, limits: Limits):
        self.coord = coordinator
        self.limits = limits
        self.max_chunk_bytes = coordinator.config.max_chunk_bytes
        self.queued = 0  # uploads staged or waiting to be (:meth:`upload_queue`)
        self._staging: StagingSlots | None = None

    @contextmanager
    def upload_queue(self) -> Iterator[None]:
        """Hold a place among the uploads that are staged or waiting to be; refuse when they are full.

        Every waiting upload has up to one HTTP/2 window of data buffered in the transport, so bounding
        the queue keeps that memory independent of how many agents upload at once.
        """
        max_queued = self.coord.config.max_queued_uploads
        if self.queued >= max_queued:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the coordinator is busy with {self.queued} uploads "
                          f"(--max-queued-uploads {max_queued}); retry in a moment")
        self.queued += 1
        try:
            yield
        finally:
            self.queued -= 1

    def small_receiver(self, request: pb.SmallUpload) -> Callable[[Upload], Awaitable[None]]:
        """What stages a SmallUpload's bytes once its header passed, after checking their size."""

        async def receive(upload: Upload) -> None:
            layout = upload.ticket.layout
            if len(request.data) != layout.total_bytes:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"SmallUpload carries {len(request.data)} bytes but its tensors need "
                              f"{layout.total_bytes}; the update was not applied", final=True)
            if layout.total_bytes > self.max_chunk_bytes:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"an update of {layout.total_bytes} bytes is larger than one chunk "
                              f"({self.max_chunk_bytes}); send it with UploadUpdate", final=True)
            if request.data:
                upload.write(0, request.data)

        return receive

    def open(self, agent: AgentRecord, header: pb.UploadHeader, issued: tuple[int, str] | None = None,
             prepaid: bool = False) -> Upload:
        """Admit ``agent``'s upload (loop): its limits are held until :meth:`settle`; a Refusal leaves nothing held.

        ``issued``: (round, task id) the transport's ticket was issued for, which the header must name.
        ``prepaid``: charge the whole upload to the agent's byte rate now (refunded in part if it breaks off).
        """
        held = ExitStack()
        ticket = None
        try:
            held.enter_context(self.limits.agent_call(agent.agent_id))
            held.enter_context(self.upload_queue())
            if issued is not None and (header.round, header.task_id) != issued:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the upload header names round {header.round} task {header.task_id[:64]!r}, but the "
                              f"ticket is for round {issued[0]} task {issued[1]!r}")
            ticket = open_ticket(self.coord, agent, header)
            self.limits.start_upload(agent.agent_id, ticket.state.round_id)  # counted in the round the header opened
            upload = Upload(self, agent.agent_id, ticket, held)
            if prepaid:  # so an agent over its rate is refused before it sends the data
                self.limits.count_bytes(agent.agent_id, ticket.layout.total_bytes)
                upload.prepaid = ticket.layout.total_bytes
        except BaseException as exc:
            if ticket is not None:
                ticket.settle(exc if isinstance(exc, Refusal) else None)
            state = ticket.state if ticket is not None else self.coord.current
            if isinstance(exc, Refusal) and state is not None:  # counted in the round it was refused in
                state.note_refusal(exc)
            held.close()
            raise
        return upload

    def settle(self, upload: Upload, refused: Refusal | None, received: int = 0) -> None:
        """The upload ended (loop): release its limits, refund prepaid bytes that never came, and record the
        outcome on its ticket (a final refusal rejects the update; otherwise it may come again)."""
        upload.held.close()
        self.limits.refund_bytes(upload.agent_id, upload.prepaid - received)
        upload.ticket.settle(refused)
        if refused is not None:
            upload.ticket.state.note_refusal(refused)

    @property
    def staging_slots(self) -> StagingSlots:
        """The staging slots (each staged upload holds one model copy), made on the loop at first use."""
        if self._staging is None:
            self._staging = StagingSlots(self.coord.config.max_concurrent_uploads)
        return self._staging

    async def reserve_staging(self, upload: Upload, interrupt: Callable[[], None],
                              seconds: float | None = None) -> SlotHold:
        """Wait for a staging slot for ``upload`` (loop) and start its pace; ``interrupt()`` stops its wait for
        bytes if the slot is taken back (it fell behind while others waited). TimeoutError after ``seconds``."""
        hold = await self.staging_slots.acquire((upload.agent_id, upload.round_id), upload.pace, interrupt, seconds)
        upload.pace.restart()
        return hold

    def release_staging(self, hold: SlotHold) -> None:
        """Give back a slot taken by :meth:`reserve_staging` (loop)."""
        self.staging_slots.release(hold)

    @asynccontextmanager
    async def staging_slot(self, upload: Upload) -> AsyncIterator[None]:
        """Hold a staging slot for ``upload`` for the block; ``upload.overtaken`` is done if it is taken back."""
        upload.overtaken = asyncio.get_running_loop().create_future()
        hold = await self.reserve_staging(upload, lambda: upload.overtaken.done() or upload.overtaken.set_result(None))
        try:
            yield
        finally:
            self.release_staging(hold)

    async def take(self, agent: AgentRecord, header: pb.UploadHeader,
                   receive: Callable[[Upload], Awaitable[None]]) -> pb.UploadReply:
        """A whole upload on the loop: open it, ``await receive(upload)`` to stage its bytes, check and accept
        them; a refusal (raised on to the caller) or a vanished agent leaves nothing of it in the round."""
        upload = refused = None
        try:
            upload = self.open(agent, header)
            async with self.staging_slot(upload):
                await receive(upload)
                return await upload.accept(await upload.checked_arrays())
        except Refusal as r:
            refused = r
            raise
        finally:
            if upload is not None:
                self.settle(upload, refused)
            # The refusal's traceback holds this frame: a local naming the refusal would make a cycle that only a
            # full gc collection frees, and it keeps the call's request (its protobuf arena) and staging alive.
            refused = None
