"""A client runtime's connection keeps one channel (and stub) per aggregator rank, however many seats ask at once: a
population host's batches to a rank go on one stream, and a second stub would open a second stream, which the rank
refuses (one per host)."""

from __future__ import annotations

import sys
import threading

import pytest

from fedpar.client.agent import AgentConfig
from fedpar.client.links import MAX_INGEST_ADDRESSES, Connection
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


def test_a_coordinator_naming_a_new_rank_each_round_is_refused_past_the_cap_and_odd_addresses_at_once():
    conn = Connection(AgentConfig(server="127.0.0.1:1", agent_id="a", insecure=True))
    try:
        for port in range(2, 2 + MAX_INGEST_ADDRESSES):
            conn.check_ingest(pb.TrainTask(ingest_port=port))
            conn.ingest_stub(pb.TrainTask(ingest_port=port))
        conn.check_ingest(pb.TrainTask(ingest_port=2))  # one kept already: fine
        conn.check_ingest(pb.TrainTask(ingest_port=1))  # the coordinator dialed: fine
        with pytest.raises(ValueError, match=f"one more than the {MAX_INGEST_ADDRESSES} this agent keeps dialed"):
            conn.check_ingest(pb.TrainTask(ingest_port=2 + MAX_INGEST_ADDRESSES))
        for task in (pb.TrainTask(ingest_port=70000), pb.TrainTask(ingest_port=9, ingest_host="a\nb"),
                     pb.TrainTask(ingest_port=9, ingest_host="h" * 300)):
            with pytest.raises(ValueError, match="which cannot be dialed"):
                conn.check_ingest(task)
    finally:
        conn.close()
