"""A driver that plays every client and the server of one in-process SecAgg+ round, with chosen dropouts."""

from __future__ import annotations

import numpy as np
import pytest

from fedpar.secagg.client_protocol import SecAggClient
from fedpar.secagg.params import RoundParams
from fedpar.secagg.server_protocol import SecAggServer


class Round:
    """All parties of one round; ``drop_at[id] = stage`` makes that client vanish before ``stage``."""

    def __init__(self, ids, length, clip=1.0, max_weight=100, neighbours=None, threshold=None, round_id=3):
        self.params = RoundParams.create(round_id, ids, length, clip, max_weight, neighbours, threshold)
        self.server = SecAggServer(self.params)
        self.clients = {i: SecAggClient(self.params, i, np.random.default_rng(hash(i) % 2**32)) for i in ids}

    def run(self, updates: dict, weights: dict, drop_at: dict | None = None):
        """Run all four stages; returns the SecAggResult (or raises SecAggAbort)."""
        drop_at = drop_at or {}
        s, ids = self.server, sorted(self.clients)

        def alive(stage):
            order = ["advertise", "share", "mask", "unmask"]
            return [i for i in ids if i not in drop_at or order.index(drop_at[i]) > order.index(stage)]

        for i in alive("advertise"):
            s.receive_advertise(self.clients[i].advertise())
        s.close_advertising()
        for i in alive("share"):
            s.receive_shares(self.clients[i].share_keys(s.key_broadcast(i)))
        s.close_sharing()
        for i in alive("mask"):
            s.receive_masked(self.clients[i].masked_input(s.routed_shares(i), updates[i], weights[i]))
        s.close_masking()
        for i in alive("unmask"):
            s.receive_unmask(self.clients[i].unmask(s.unmask_request(i)))
        return s.finish()

    @staticmethod
    def plain(updates: dict, weights: dict, ids, clip: float = 1.0):
        """sum_i w_i * clip(x_i) in float64, and sum_i w_i, over ``ids``."""
        total = sum(weights[i] * np.clip(np.asarray(updates[i], np.float64), -clip, clip) for i in ids)
        return total, sum(weights[i] for i in ids)


@pytest.fixture
def make_round():
    """``make_round(ids, length, **params)`` -> Round."""
    return Round

