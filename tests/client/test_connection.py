"""A client runtime's connection keeps one channel (and stub) per aggregator rank, however many seats ask at once: a
population host's batches to a rank go on one stream, and a second stub would open a second stream, which the rank
refuses (one per host)."""

from __future__ import annotations

import sys
import threading

from fedpar.client.agent import AgentConfig
from fedpar.client.links import Connection
from fedpar.protocol import fedpar_pb2 as pb


def test_seats_asking_at_once_for_a_ranks_stub_all_get_the_same_one():
    conn = Connection(AgentConfig(server="127.0.0.1:1", agent_id="a", insecure=True))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns at almost every bytecode: a race shows at once
    try:
        for port in range(2, 12):  # a new rank's address each time: its channel is opened by the first to ask
            task = pb.TrainTask(ingest_port=port)
            start, stubs = threading.Barrier(8), []

            def ask():
                start.wait()
                stubs.append(conn.ingest_stub(task))
            seats = [threading.Thread(target=ask) for _ in range(8)]
            for seat in seats:
                seat.start()
            for seat in seats:
                seat.join()
            assert len({id(stub) for stub in stubs}) == 1, port
        assert conn.ingest_stub(pb.TrainTask()) is conn.stub  # no rank named: the coordinator dialed
    finally:
        sys.setswitchinterval(interval)
        conn.close()
