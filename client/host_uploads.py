"""A client runtime hosting a population (client/links.HostLink) sends its members' small updates together: one
batch (a HostUploads message) carries whatever updates are waiting when it can go, each with its member's session and
checked by the coordinator as UploadSmall would be. While one batch is in flight the next updates queue up, so
batches grow with the load by themselves. The runtime's batches all go on its one HostUploadStream, opened at the first
and again after a failure (a call's set-up is most of a small batch's cost in gRPC: benchmarks/grpc_call_cost.py).

A seat either waits for its update's own result (:meth:`HostUploads.send`: top-k error feedback must know whether
its update counted) or hands the update over and goes on with its next client (:meth:`HostUploads.send_later`):
then the update travels in the background, a busy coordinator's refusal is retried while its deadline allows, and
any other refusal is logged. Uploads are never left out of the coordinator's checks either way.

Updates come as their arrays (client/transfer.SmallUpdate) and are encoded only to go on their own. Background
updates of a batch (plain weights, one round) go as one pre-summed partial where the coordinator takes one
(client/host_partial.py: a linear strategy with no share cap; compressed, masked or DP-clipped updates and top-k's
awaited ones go one by one): the host checks each as the coordinator would and sums those that pass straight from
their arrays (the rows of one stack of members trained together with one op over the stack); the coordinator checks
and folds the partial as one. An update that fails a check goes on its own, so the coordinator refuses and
counts it as it always does (a rejected update may close the round). A coordinator that takes no partial in this run
says so once (UNIMPLEMENTED) and the host sends its updates one by one from then on; any other refusal of a partial
sends its members' updates one by one, each to its own verdict. FEDPAR_HOST_PARTIALS=0 turns partials off (comparisons).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import grpc

from fedpar.client.host_partial import HostSum, summable
from fedpar.client.host_stream import CallRefused, KeptStream
from fedpar.client.transfer import UPLOAD_RETRYABLE, SmallUpdate, refuses_connections
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CoordinatorStub, one_line
from fedpar.protocol.round_refusals import says_round_closed

log = logging.getLogger("fedpar.simulate")
RETRY_PAUSE = 0.1  # seconds before a background update the coordinator was too busy for goes again
TELL_SECONDS = 30.0  # for the coordinator's answer to a message telling members' failed tasks
_CODES = {c.value[0]: c for c in grpc.StatusCode}


@dataclass
class _Queued:
    """One update waiting for a batch: the update, when it stops being worth sending, who hears the result."""

    update: SmallUpdate
    deadline: float  # time.monotonic()
    done: Future
    background: bool


class HostUploads:
    """Batches a host's small updates into HostUploads messages of at most ``max_bytes`` each on the host's one
    HostUploadStream (one thread); a
    batch waits up to ``linger`` seconds for more updates after its first, while ``more_coming()`` says the seats
    are still making some (the last updates of a round go at once, and so does a batch holding an update whose seat
    waits for its result). The thread sleeps until an update is queued or
    :meth:`nudge` says ``more_coming()`` may have changed: whoever changes it nudges (no polling)."""

    def __init__(self, stub: CoordinatorStub, host: pb.AgentAuth, max_bytes: int, linger: float = 0.0,
                 max_updates: int = 512, more_coming: Callable[[], bool] = lambda: True,
                 registered: Callable[[str], tuple[int, int]] | None = None, rank: str = ""):
        self.stub, self.host, self.max_bytes = stub, host, max_bytes
        self.rank = rank  # the aggregator rank's address the batches go to ('' for the coordinator)
        self.rank_gone = False  # the rank refused a connection: its updates are given up (said once)
        self._stream = KeptStream(stub.HostUploadStream, "upload stream")  # opened at the first batch
        self.max_updates, self.linger, self.more_coming = max_updates, linger, more_coming
        self._queue: collections.deque = collections.deque()  # _Queued items; None: stop
        self._changed = threading.Condition()  # guards _queue, _queued_bytes, _awaited and _idle
        self._queued_bytes = 0  # of the updates in _queue
        self._awaited = 0  # updates in _queue whose seat waits for their result (send): their batch does not linger
        self._idle = False  # the thread waits for a batch's first update
        self._failures: list[pb.TaskFailure] = []  # members' failed tasks to tell (see :meth:`tell`)
        self._closed = False  # close() was called: what comes after is refused, no thread would send it
        self.refused_in_background = 0  # updates sent with send_later that did not count (came_after_close aside)
        self.came_after_close = 0  # ... refused only because their round had closed: overselection's surplus, normal
        # a member's registered examples and the round's local epochs (its weight's bound); None: no partials
        self.registered = registered
        self.partials = registered is not None and os.environ.get("FEDPAR_HOST_PARTIALS", "1") != "0"
        self.partials_sent = 0  # partials the coordinator accepted
        self._thread = threading.Thread(target=self._run, name="fedpar-host-uploads", daemon=True)
        self._thread.start()

    def send(self, stub: CoordinatorStub, update: SmallUpdate, timeout: float,
             abandoned: Callable[[], bool] | None = None) -> pb.UploadReply:
        """Send ``update`` in the next batch and wait for its own result (the runtime's small-upload call; ``stub``
        is the task's, unused: the host's channel carries the batch, whose thread ends its calls; ``abandoned``
        likewise)."""
        item = _Queued(update, time.monotonic() + timeout, Future(), background=False)
        self._put(item)
        return item.done.result()

    def send_later(self, stub: CoordinatorStub, update: SmallUpdate, timeout: float,
                   abandoned: Callable[[], bool] | None = None) -> pb.UploadReply:
        """Queue ``update`` for the next batch and return at once, so the seat goes on with its next client."""
        self._put(_Queued(update, time.monotonic() + timeout, Future(), background=True))
        return pb.UploadReply(accepted=True, message="queued")

    def tell(self, failure: pb.TaskFailure) -> None:
        """Tell the coordinator at once (in a message of its own, before the next batch) that a member's own code
        failed its task, so that the round stops waiting for it; not said again if that message fails (the host's
        next long-poll tells it too)."""
        with self._changed:
            if self._closed:
                return
            self._failures.append(failure)
            self._changed.notify()

    def close(self) -> None:
        """Stop after the batches already queued."""
        self._put(None)
        self._thread.join(timeout=30)

    def nudge(self) -> None:
        """``more_coming()`` may have turned False (the seats are done with their tasks): a lingering batch goes."""
        with self._changed:
            self._changed.notify()

    def _put(self, item: _Queued | None) -> None:
        with self._changed:
            if self._closed:  # a seat that outlived the run: its update has no batch to go in
                if item is not None:
                    item.done.set_exception(CallRefused(grpc.StatusCode.UNAVAILABLE,
                                                        "the host's uploads are closed: training is over"))
                return
            self._closed = item is None
            self._queue.append(item)
            if item is not None:
                self._queued_bytes += item.update.size
                self._awaited += not item.background
            # a lingering batch is not woken for each background update (a wake-up per update cost the seats more CPU
            # than the batch's own work): only when a batch can start, must end (close, full, an awaited update) or
            # the seats are done (nudge)
            if self._idle or item is None or self._full() or not item.background:
                self._changed.notify()

    def _full(self) -> bool:
        return len(self._queue) >= self.max_updates or self._queued_bytes >= self.max_bytes

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            batch, failures = batch
            if failures:
                self._tell(failures)
            self._send(batch)
            if batch and batch[-1] is None:
                break
        self._stream.close()

    def _next_batch(self) -> tuple[list[_Queued | None], list[pb.TaskFailure]] | None:
        """The next batch to send: the updates queued when its first came and within the linger after it while
        more are coming, up to ``max_updates`` and ``max_bytes`` (ending with None when close() came meanwhile),
        and the failures to tell first (a failure does not wait for a linger); None: closed, nothing left."""
        with self._changed:
            self._idle = True
            while not self._queue and not self._failures:
                self._changed.wait()
            self._idle = False
            until = time.monotonic() + self.linger
            # more_coming() is read under the lock nudge() takes: a seat that stops counting after this look wakes
            # the wait. A batch holding an awaited update goes at once: its seat waits for its result, so lingering
            # for the other seats' updates would stall it (and, all seats awaiting, every seat) for the whole linger.
            while self._queue and self._queue[-1] is not None and not self._failures and not self._awaited \
                    and not self._full() and self.more_coming():
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            batch, size = [], 0
            while self._queue and len(batch) < self.max_updates:
                item = self._queue[0]
                if item is not None and batch and size + item.update.size > self.max_bytes:
                    break  # the next batch starts with it (order among seats does not matter)
                self._queue.popleft()
                batch.append(item)
                if item is None:
                    break
                size += item.update.size
                self._queued_bytes -= item.update.size
                self._awaited -= not item.background
            failures, self._failures = self._failures, []
            return (batch, failures) if batch != [None] or failures else None

    def _send(self, batch: list[_Queued | None]) -> None:
        """Send ``batch``: its background plain updates of one round as a partial where the coordinator takes one,
        the rest (and any a partial could not carry) one by one."""
        batch = [q for q in batch if q is not None]
        if not batch:
            return
        rest = self._send_partial(batch) if self.partials else batch
        if rest:
            self._send_each(rest)

    def _tell(self, failures: list[pb.TaskFailure]) -> None:
        """One message telling ``failures``; a refusal is logged (the host's next long-poll tells them too)."""
        try:
            self._call(pb.HostUploads(host=self.host, failures=failures), TELL_SECONDS)
        except grpc.RpcError as err:
            log.info("%s: %d failed tasks not told at once (%s: %s); the next long-poll tells them",
                     self.host.agent_id, len(failures), err.code().name, one_line(err.details() or ""))

    def _send_partial(self, batch: list[_Queued]) -> list[_Queued]:
        """Sum the batch's background plain updates of its first such update's round, metric names and layout into
        one partial, straight from their arrays, and send it; the updates still to send one by one."""
        first = next((q for q in batch if q.background and not q.update.header.encoding), None)
        if first is None:
            return batch
        head = first.update.header
        names = tuple(sorted(head.metrics))
        group = [q for q in batch if q.background and not q.update.header.encoding
                 and q.update.header.round == head.round and tuple(sorted(q.update.header.metrics)) == names
                 and q.update.layout.tensors == first.update.layout.tensors]
        if len(group) < 2 or not summable(first.update.layout):
            return batch
        partial = HostSum(first.update.layout, head.round, names)
        summed = self._sum_into(partial, group)
        grouped = {id(q) for q in summed}
        rest = [q for q in batch if id(q) not in grouped]
        if not summed:
            return rest
        try:
            reply = self._call(pb.HostUploads(host=self.host, partial=partial.message()),
                               max(0.5, min(q.deadline for q in summed) - time.monotonic()))
        except grpc.RpcError as err:
            for q in summed:
                self._settle(q, err)
            return rest
        result = reply.partial
        if not reply.HasField("partial") or result.code == grpc.StatusCode.UNIMPLEMENTED.value[0]:
            self.partials = False  # this run takes none: one by one from now on
            log.info("%s: the coordinator takes no pre-summed updates (%s); sending each member's update",
                     self.host.agent_id, one_line(result.message or "it does not know them"))
            return rest + summed
        if result.code:  # e.g. a member's update counted meanwhile: each of the others to its own verdict
            log.info("%s: a partial of %d updates was refused (%s); sending them one by one", self.host.agent_id,
                     len(summed), one_line(result.message))
            return rest + summed
        self.partials_sent += 1
        log.debug("%s: a partial of %d updates (%d of them rows of a stack) accepted", self.host.agent_id, len(summed),
                  sum(q.update.rows is not None for q in summed))
        for q in summed:
            q.done.set_result(pb.UploadReply(accepted=True, message=result.message))
        return rest

    def _sum_into(self, partial: HostSum, group: list[_Queued]) -> list[_Queued]:
        """Add ``group``'s updates that pass the host's checks to ``partial``: the rows of one stack with one op over
        it, the others one by one; those added (a failed one goes on its own, to the coordinator's verdict)."""
        summed, stacks = [], {}
        for q in group:
            header = q.update.header
            try:
                registered = self.registered(header.auth.agent_id)
            except (ValueError, KeyError) as exc:
                log.info("%s: %s is sent on its own: %s", self.host.agent_id, header.auth.agent_id, exc)
                continue
            rows = q.update.rows
            if rows is not None:
                stacks.setdefault(id(rows.source), []).append((q, registered))
                continue
            try:
                partial.add(header.auth.agent_id, header.task_id, q.update.arrays, header.num_examples, header.steps,
                            header.metrics, registered)
                summed.append(q)
            except ValueError as exc:  # the coordinator refuses it on its own, and counts the refusal
                log.info("%s: %s is sent on its own: %s", self.host.agent_id, header.auth.agent_id, exc)
        for members in stacks.values():
            members.sort(key=lambda member: member[0].update.rows.row)  # seats queue theirs as they finish
            stacked = members[0][0].update.rows.stacked
            index = [q.update.rows.row for q, _ in members]
            if index != list(range(len(stacked[0]))):  # not the whole stack: its rows of it
                stacked = [x[index] for x in stacked]
            headers = [q.update.header for q, _ in members]
            errors = partial.add_stacked([h.auth.agent_id for h in headers], [h.task_id for h in headers], stacked,
                                         [h.num_examples for h in headers], [h.steps for h in headers],
                                         [h.metrics for h in headers], [r for _, r in members])
            for (q, _), exc in zip(members, errors):
                if exc is None:
                    summed.append(q)
                else:
                    log.info("%s: %s is sent on its own: %s", self.host.agent_id, q.update.header.auth.agent_id, exc)
        return summed

    def _send_each(self, batch: list[_Queued]) -> None:
        """One call for ``batch``; each update's result goes to its seat, or is retried or logged."""
        try:
            reply = self._call(pb.HostUploads(host=self.host, uploads=[q.update.message for q in batch]),
                               max(0.5, min(q.deadline for q in batch) - time.monotonic()))
            results = list(reply.results)
        except grpc.RpcError as err:
            for q in batch:
                self._settle(q, err)
            return
        results += [pb.HostUploadResult(code=grpc.StatusCode.INTERNAL.value[0],
                                        message="the coordinator sent no result for it")] * (len(batch) - len(results))
        for q, result in zip(batch, results):
            if result.code:
                self._settle(q, CallRefused(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.message))
            else:
                q.done.set_result(pb.UploadReply(accepted=result.accepted, message=result.message))

    def _call(self, request: pb.HostUploads, timeout: float) -> pb.HostUploadResults:
        """One batch's results, on the host's stream (opened again after a failure)."""
        return self._stream.send(request, timeout)

    def _settle(self, q: _Queued, err: grpc.RpcError) -> None:
        """A refused update: its seat hears it; a background one is tried again while the coordinator is busy and
        its deadline allows, else logged."""
        if not q.background:
            q.done.set_exception(err)
        elif self.rank and refuses_connections(err, self.rank):  # a dead rank's port (client/transfer.py's RankGone)
            self.refused_in_background += 1
            if not self.rank_gone:
                self.rank_gone = True
                log.warning("%s: aggregator rank %s refuses connections (it stopped, or its service restarted): the "
                            "updates for it are given up", self.host.agent_id, self.rank)
        elif err.code() in UPLOAD_RETRYABLE and time.monotonic() + RETRY_PAUSE < q.deadline:
            threading.Timer(RETRY_PAUSE, self._put, (q,)).start()
        elif after_close(err):
            self.came_after_close += 1
            log.debug("an update sent in the background came after its round had closed: %s",
                      one_line(err.details() or ""))
        else:
            self.refused_in_background += 1
            log.info("an update sent in the background was refused: %s: %s", err.code().name,
                     one_line(err.details() or ""))


def after_close(err: grpc.RpcError) -> bool:
    """Whether ``err`` refused an update only because its round had closed (server/rounds.py check_open and
    not_this_round's 'came too late'), as the surplus of an overselected round is."""
    return err.code() == grpc.StatusCode.FAILED_PRECONDITION and says_round_closed(err.details() or "")
