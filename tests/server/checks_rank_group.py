"""Checks of the aggregator ranks' group on 2 gloo ranks, run by tests/server/test_rank_group.py in one spawned
process group (support/spawn_checks.py)."""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from fedpar.server.ranks import group as rank_group


def check_broadcast_arrays_in_buckets() -> dict:
    """A model's tensors of mixed dtypes and shapes (a 0-d one too) reach rank 1 bit for bit when small ones share a
    bucket and a large one goes alone, in the buckets both ranks cut alike; rank 0's strided array is read as is."""
    rank_group.BROADCAST_BUCKET_BYTES = 64  # so this small model needs several buckets and one tensor goes alone
    group = rank_group.RankGroup(30.0, "fedpar/ranks/check")
    rng = np.random.default_rng(7)
    model = [rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float16),
             np.arange(4, dtype=np.int64).reshape(2, 2), np.array(2.5), rng.standard_normal(40).astype(np.float32),
             rng.standard_normal((2, 3)).astype(np.float64)]
    if dist.get_rank() == 0:
        arrays = [*model[:5], np.asfortranarray(model[5])]  # rank 0 may hold a strided array: it is read as is
    else:
        arrays = [np.zeros_like(a) for a in model]
    group.broadcast_arrays(arrays)
    same = all(a.dtype == m.dtype and a.shape == m.shape and a.tobytes() == m.tobytes()
               for a, m in zip(arrays, model))
    refused = ""
    if dist.get_rank() == 1:
        try:
            group.broadcast_arrays([np.zeros((4, 4), np.float32)[:, ::2]])  # a strided receiver: refused, not lost
        except ValueError as exc:
            refused = str(exc)
    return {"same": float(same), "refused": float(refused == "broadcast_arrays fills C-contiguous arrays in place")
            if dist.get_rank() == 1 else 1.0}


def check_control_messages_of_any_size() -> dict:
    """Rank 0's control messages reach rank 1 whole: a short one in one broadcast with its length, one longer than
    MESSAGE_HEAD_BYTES in two, and one at exactly that length; in order."""
    from fedpar.protocol import fedpar_pb2 as pb

    group = rank_group.RankGroup(30.0, "fedpar/ranks/check-messages")
    def agent(agent_id: str) -> pb.RankAgent:
        return pb.RankAgent(rank=1, agent_id=agent_id, task_id="t", token="x" * 40, num_examples=3, cert_serial=b"",
                            ticket=b"", host="")

    many = [agent(f"client-{k:05d}") for k in range(300)]  # about 21 KB: a long RankOpen
    sent = [pb.RankBroadcast(stop=pb.RankStop()),
            pb.RankBroadcast(open=pb.RankOpen(round=7, deadline_seconds=2.5, agents=many, round_values=[0.5, 1.5])),
            pb.RankBroadcast(model=pb.RankModel(round=7, changed=True))]
    exact = pb.RankBroadcast(open=pb.RankOpen(round=1, deadline_seconds=1.0, agents=[agent("")]))
    while len(exact.SerializeToString()) < rank_group.MESSAGE_HEAD_BYTES:  # grow it to the head's length exactly
        exact.open.agents[0].agent_id += "a" * max(1, (rank_group.MESSAGE_HEAD_BYTES - len(exact.SerializeToString()))
                                                   // 2)
    sent.append(exact)
    same = True
    for message in sent:
        if dist.get_rank() == 0:
            group.send(message)
        else:
            same = same and group.receive() == message
    long_enough = len(sent[1].SerializeToString()) > rank_group.MESSAGE_HEAD_BYTES
    exactly = len(exact.SerializeToString()) == rank_group.MESSAGE_HEAD_BYTES
    return {"same": float(same), "long": float(long_enough and exactly),
            "sizes": [float(len(m.SerializeToString())) for m in sent]}


def check_a_hung_rank_costs_the_configured_timeout_not_the_start_ups() -> dict:
    """Joined with the start-up's long timeout (60 s here, as `simulate`'s ranks join), the group's collectives after
    its first (the endpoints' exchange) fail after the configured 2 s: rank 1 stays out of an all-gather until rank 0
    gave up on it; then rank 0 forms the group again with it, and a collective goes through."""
    import time
    from datetime import timedelta

    group = rank_group.RankGroup(2.0, "fedpar/ranks/check-timeout")
    me = rank_group.RankEndpoint(group.rank, "", 1000 + group.rank, 0)
    group.exchange_endpoints(me)
    gave_up = "check/rank-0-gave-up"
    if group.rank == 0:
        started = time.monotonic()
        try:
            group.gather_floats([1.0])
            missing = ""
        except rank_group.RankMissing as exc:
            missing = str(exc)
        waited = time.monotonic() - started
        group.store.set(gave_up, b"1")
        group.reform([0, 1])
    else:
        group.store.wait([gave_up], timedelta(seconds=120))
        group.rejoin()
        waited, missing = 0.0, "all-gather"
    rows = group.gather_floats([float(group.rank)])
    return {"waited": waited, "missing": float("all-gather" in missing),
            "after": rows[1][0] if group.rank == 0 else 1.0}
