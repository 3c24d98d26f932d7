"""An agent whose task names an aggregator rank's port that refuses connections (the rank died: its coordinator was
killed and started again, so the old rank's random port is closed) gives that upload up at once and goes back to
the coordinator's main address, where it pulls (and joins again) as after any coordinator restart. It retried the
dead port until the round's deadline (60 s, or however long the round was), missing the restarted service's rounds.
A real `fedpar client` against a coordinator on 127.0.0.1 (tests/support/hostile_coordinator.py: real gRPC) whose
heartbeats say, as a restarted one's do, that it no longer knows the agent's session."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from support.hostile_coordinator import HostileCoordinator, digits_layout, inline_task, run_agent, weights_of
from support.ports import free_port

pytestmark = pytest.mark.timeout(180)
DEADLINE = 300.0  # the round's: the agent must not wait it out



class _Restarted(HostileCoordinator):
    """Heartbeats, and the first pull after the task, refused UNAUTHENTICATED (a restarted coordinator knows no
    session: the agent joins again); the time of each pull."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pulled_at: list[float] = []
        self._lock = threading.Lock()

    def _pull(self, request, context):
        with self._lock:
            self.pulled_at.append(time.monotonic())
            forgotten = len(self.pulled_at) == 2
        if forgotten:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown session")
        return super()._pull(request, context)

    def _heartbeat(self, request, context):
        self.heartbeats += 1
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown session")


def test_an_upload_to_a_rank_that_refuses_connections_is_given_up_and_the_agent_pulls_again(tmp_path):
    layout = digits_layout()
    dead = free_port()
    coordinator = _Restarted([inline_task(layout, weights_of(layout, 0.01), deadline_seconds=DEADLINE,
                                          ingest_host="127.0.0.1", ingest_port=dead)])
    try:
        code, out = run_agent(coordinator, tmp_path, seconds=120)
    finally:
        coordinator.stop()
    assert "Traceback" not in out, out
    assert code == 0 and coordinator.uploads == [], out  # the coordinator's next reply was its shutdown
    pulls = coordinator.pulled_at
    assert len(pulls) >= 3 and coordinator.joins == 2, out  # pulled again, was not known, joined again, pulled
    assert pulls[1] - pulls[0] < DEADLINE / 5, (pulls[1] - pulls[0], out)  # training, then the upload given up
    assert coordinator.pulls[-1].finished_task_id == "t1", coordinator.pulls[-1]
    said = [line for line in out.splitlines() if f"127.0.0.1:{dead}" in line]
    assert len(said) == 1 and said[0].endswith(
        f"a: upload refused: aggregator rank 127.0.0.1:{dead} refuses connections (it stopped, or its service "
        f"restarted): round 1's update is given up; back to the coordinator at {coordinator.address}"), out


@pytest.mark.parametrize("rank", [True, False])
def test_a_hosts_background_updates_to_a_rank_that_refuses_connections_are_given_up_at_once(rank, caplog):
    """A simulation host's batches (client/host_uploads.py) to a dead rank's port are given up at the first refusal
    and said once; to the coordinator's own address the same refusal is retried until the update's deadline (a
    coordinator restarting takes its port back)."""
    import logging

    import numpy as np

    from fedpar.client.host_uploads import HostUploads
    from fedpar.client.transfer import SmallUpdate
    from fedpar.protocol.codec import CoordinatorStub, ModelLayout

    address = f"127.0.0.1:{free_port()}"
    stub = CoordinatorStub(grpc.insecure_channel(address))
    uploads = HostUploads(stub, pb.AgentAuth(agent_id="host-a"), max_bytes=1 << 20, rank=address if rank else "")
    update = SmallUpdate(pb.UploadHeader(task_id="t"), ModelLayout([("t", "uint8", (8,))]), [np.zeros(8, np.uint8)])
    deadline = 2.0
    caplog.set_level(logging.INFO, logger="fedpar.simulate")
    start = time.monotonic()
    for _ in range(3):
        uploads.send_later(stub, update, deadline)
    while uploads.refused_in_background < 3 and time.monotonic() - start < 10:
        time.sleep(0.01)
    seconds = time.monotonic() - start
    uploads.close()
    assert uploads.refused_in_background == 3
    said = [r.getMessage() for r in caplog.records if "refuses connections" in r.getMessage()]
    if rank:
        assert seconds < deadline / 2, seconds
        assert said == [f"host-a: aggregator rank {address} refuses connections (it stopped, or its service "
                        "restarted): the updates for it are given up"], said
    else:
        assert seconds >= deadline - 0.5 and said == [], (seconds, said)
