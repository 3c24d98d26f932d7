"""`fedpar client --server` given a coordinator's data-plane port (the port its tasks offer for the weights, which
speaks no gRPC) was retried for ever as 'coordinator unreachable' (QA); it is said at once in one line."""

from __future__ import annotations

import time

import numpy as np

from fedpar.client.dataplane import answers_as_data_plane

from support.in_process import run_main


def test_an_agent_given_the_data_plane_port_says_so_at_once(start_coordinator, capfd):
    server = start_coordinator([np.zeros((4, 2), np.float32), np.zeros(2, np.float32)], data_plane=True,
                               clients_per_round=1, min_available=1)
    data = f"127.0.0.1:{server.coordinator.data_port}"
    assert answers_as_data_plane(server.address, 1.0) is None  # the agents' own port is gRPC's
    assert answers_as_data_plane("127.0.0.1:1", 1.0) is None  # nothing listens
    started = time.monotonic()
    done = run_main(["client", "--server", data, "--agent-id", "alice", "--insecure", "--threads", "1",
                     "--give-up-after", "20"], capfd)  # retried as unreachable before: it gave up after 20 s
    assert done.returncode == 1 and "Traceback" not in done.stderr and "retrying" not in done.stderr, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("fedpar client:")] == [
        f"fedpar client: alice: {data} is a coordinator's data-plane port (the one its tasks offer for the weights), "
        "not its agents' port; give --server the coordinator's --port"], done.stderr
    assert time.monotonic() - started < 30
