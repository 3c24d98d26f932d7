"""A host's upload batches: updates queued while seats are still training wait (up to the linger) to go together;
once no seat is making one, or a seat waits for its own update's result, what is queued goes at once, all on the
host's one stream. The stub here only records
the batches (their real gRPC path is tested in tests/server/test_host_upload_stream.py and by every simulation)."""

from __future__ import annotations

import threading
import time

import numpy as np

from fedpar.client.host_uploads import HostUploads
from fedpar.client.transfer import SmallUpdate
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout


class _RecordingStub:
    """Stands in for the coordinator's HostUploadStream: records each batch as it arrives on the stream."""

    def __init__(self):
        self.batches: list[tuple[float, int]] = []
        self.streams = 0
        self.sent = threading.Event()

    def HostUploadStream(self, requests):  # noqa: N802 (gRPC's method name)
        self.streams += 1
        return _Replies(self, requests)


class _Replies:
    def __init__(self, stub: _RecordingStub, requests):
        self.stub, self.requests = stub, requests

    def __iter__(self):
        return self

    def __next__(self) -> pb.HostUploadResults:
        request = next(self.requests)
        self.stub.batches.append((time.monotonic(), len(request.uploads)))
        self.stub.sent.set()
        return pb.HostUploadResults(results=[pb.HostUploadResult(accepted=True) for _ in request.uploads])

    def cancel(self) -> None:
        """Nothing to end."""


def _message(i: int) -> SmallUpdate:
    return SmallUpdate(pb.UploadHeader(task_id=f"t{i}"), ModelLayout([("t", "uint8", (8,))]), [np.zeros(8, np.uint8)])


def _seats_training(linger: float, **kwargs) -> tuple[threading.Event, _RecordingStub, HostUploads]:
    """A host's uploads while its seats are still training (clear the event: they are done), on a recording stub."""
    more = threading.Event()
    more.set()
    stub = _RecordingStub()
    return more, stub, HostUploads(stub, pb.AgentAuth(agent_id="host"), max_bytes=1 << 20, linger=linger,
                                   more_coming=more.is_set, **kwargs)


def test_updates_wait_for_each_other_while_more_are_coming_and_go_at_once_when_none_are():
    more, stub, uploads = _seats_training(0.5)
    try:
        start = time.monotonic()
        uploads.send_later(None, _message(0), 10.0)
        time.sleep(0.05)
        uploads.send_later(None, _message(1), 10.0)  # within the linger: the same batch
        assert stub.sent.wait(5)
        assert [n for _, n in stub.batches] == [2] and stub.batches[0][0] - start >= 0.45
        more.clear()  # no seat is training: the round's last update does not wait
        stub.sent.clear()
        start = time.monotonic()
        uploads.send_later(None, _message(2), 10.0)
        assert stub.sent.wait(5)
        assert [n for _, n in stub.batches] == [2, 1] and stub.batches[1][0] - start < 0.3
        assert stub.streams == 1
    finally:
        uploads.close()


def test_a_lingering_batch_goes_when_its_seats_are_done_or_it_is_full_not_at_the_lingers_end():
    more, stub, uploads = _seats_training(30.0, max_updates=3)
    try:
        uploads.send_later(None, _message(0), 60.0)
        uploads.send_later(None, _message(1), 60.0)
        time.sleep(0.1)
        assert not stub.batches  # seats still training: the batch lingers (nothing polls for the change)
        start = time.monotonic()
        more.clear()
        uploads.nudge()  # the host's last seat is done with its task
        assert stub.sent.wait(5) and time.monotonic() - start < 5
        more.set()
        stub.sent.clear()
        for i in range(2, 5):  # the third fills the batch: it goes at once, seats still training
            uploads.send_later(None, _message(i), 60.0)
        assert stub.sent.wait(5) and time.monotonic() - start < 10
        assert [n for _, n in stub.batches] == [2, 3] and stub.streams == 1
    finally:
        more.clear()
        uploads.close()


def test_an_awaited_update_goes_at_once_with_what_lingers_though_seats_are_still_training():
    """Top-k's seats wait for their own update's result: a batch holding one must not linger for the other seats'
    updates (with every seat waiting, none would come, and each wave of a round stalled for the whole linger)."""
    more, stub, uploads = _seats_training(30.0)
    try:
        uploads.send_later(None, _message(0), 60.0)
        time.sleep(0.1)
        assert not stub.batches  # a background update lingers for the seats still training
        start = time.monotonic()
        reply = uploads.send(None, _message(1), 60.0)  # an awaited one wakes the batch: both go, now
        assert reply.accepted and time.monotonic() - start < 5
        assert [n for _, n in stub.batches] == [2]
        stub.sent.clear()
        start = time.monotonic()
        assert uploads.send(None, _message(2), 60.0).accepted and time.monotonic() - start < 5  # alone, at once
        assert [n for _, n in stub.batches] == [2, 1] and stub.streams == 1
    finally:
        more.clear()
        uploads.close()


def test_an_update_sent_after_the_host_closed_its_uploads_is_refused_at_once_not_left_waiting():
    stub = _RecordingStub()
    uploads = HostUploads(stub, pb.AgentAuth(agent_id="host"), max_bytes=1 << 20)
    uploads.close()
    done = []
    seat = threading.Thread(target=lambda: done.append(_refusal(uploads)), daemon=True)
    seat.start()
    seat.join(5)
    assert done == ["UNAVAILABLE: the host's uploads are closed: training is over"] and stub.batches == []
    assert stub.streams == 0


def _refusal(uploads: HostUploads) -> str:
    try:
        uploads.send(None, _message(0), 10.0)
    except Exception as exc:  # noqa: BLE001 (what the seat would hear)
        return f"{exc.code().name}: {exc.details()}"
    return "accepted"
