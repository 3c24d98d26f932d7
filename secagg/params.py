"""The public settings of one secure-aggregation round, fixed by the server and checked by every client."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property

from fedpar.secagg.errors import SecAggError
from fedpar.secagg.field import Quantizer
from fedpar.secagg.graph import (check_neighbours, default_neighbours, default_threshold, harary_graph,
                                 harary_neighbours)

MAX_ID_CHARS = 128
MAX_PARTICIPANTS = 10_000
MAX_VECTOR_LENGTH = 1 << 31
# A client shares its seeds with each neighbour and may rebuild theirs: its work grows with k squared. The default k
# (graph.default_neighbours) stays under 60 up to MAX_PARTICIPANTS; a coordinator asking for far more is refused.
MAX_NEIGHBOURS = 128
SEED_BYTES = 32


@dataclass(frozen=True)
class RoundParams:
    """Who takes part, how updates are quantized, and the neighbour graph and threshold of one round."""

    round_id: int
    participants: tuple[str, ...]  # sorted; position + 1 is each one's Shamir x-coordinate
    vector_length: int  # L: model coordinates (the masked vector has L + 1: the weight rides last)
    clip: float
    max_weight: int
    neighbours: int  # k
    threshold: int  # t: shares needed to reconstruct one secret
    graph_seed: bytes = field(repr=False)

    @classmethod
    def create(cls, round_id: int, participants, vector_length: int, clip: float, max_weight: int,
               neighbours: int | None = None, threshold: int | None = None) -> "RoundParams":
        """Settings for a round over ``participants`` with the default k and t, and a fresh graph seed."""
        people = tuple(sorted(participants))
        k = default_neighbours(len(people)) if neighbours is None else neighbours
        t = default_threshold(k) if threshold is None else threshold
        params = cls(int(round_id), people, int(vector_length), float(clip), int(max_weight), k, t,
                     os.urandom(SEED_BYTES))
        params.validate()
        return params

    @property
    def bit_value(self) -> float:
        """What a set bit (e.g. DP's clip bit, after an update) adds to the masked vector: the largest value the
        quantizer keeps, for the least rounding; the unmasked sum divided by it counts the bits."""
        return self.clip

    def validate(self) -> None:
        """Raise SecAggError unless these settings are well formed and safe for a client to accept."""
        n = len(self.participants)
        if not 2 <= n <= MAX_PARTICIPANTS:
            raise SecAggError(f"a round needs 2..{MAX_PARTICIPANTS} participants, got {n}")
        if list(self.participants) != sorted(set(self.participants)):
            raise SecAggError("participants must be distinct and sorted")
        if not all(isinstance(p, str) and 0 < len(p) <= MAX_ID_CHARS for p in self.participants):
            raise SecAggError(f"participant ids must be 1..{MAX_ID_CHARS} characters")
        if not 1 <= self.vector_length < MAX_VECTOR_LENGTH:
            raise SecAggError(f"vector_length must be in 1..{MAX_VECTOR_LENGTH - 1}")
        if self.round_id < 0 or len(self.graph_seed) != SEED_BYTES:
            raise SecAggError(f"round_id must be >= 0 and graph_seed {SEED_BYTES} bytes")
        check_neighbours(n, self.neighbours)
        if self.neighbours > max(MAX_NEIGHBOURS, default_neighbours(n)):
            raise SecAggError(f"neighbours k={self.neighbours} is above the {MAX_NEIGHBOURS} a client takes "
                              f"(the default for {n} participants is {default_neighbours(n)})")
        # A client refuses a threshold below an honest majority of its share holders: a lower one
        # would let a few colluders (or a curious server) rebuild both of its masks.
        low = default_threshold(self.neighbours)
        if not low <= self.threshold <= self.neighbours + 1:
            raise SecAggError(f"threshold {self.threshold} must be in {low}..{self.neighbours + 1} "
                              f"for k={self.neighbours} neighbours")
        self.quantizer  # validates clip, max_weight and the 31-bit budget

    @cached_property
    def quantizer(self) -> Quantizer:
        """The round's quantizer (its grid fits a sum over every participant)."""
        return Quantizer(self.clip, self.max_weight, len(self.participants))

    @cached_property
    def graph(self) -> dict[str, frozenset[str]]:
        """Neighbour sets of the round's SecAgg+ graph."""
        return harary_graph(self.participants, self.neighbours, self.graph_seed)

    def neighbours_of(self, participant: str) -> frozenset[str]:
        """``participant``'s neighbour set of :attr:`graph`, without building the whole graph (a client's view)."""
        return harary_neighbours(self.participants, self.neighbours, self.graph_seed, participant)

    @cached_property
    def index(self) -> dict[str, int]:
        """Each participant's Shamir x-coordinate (1-based position in the sorted list)."""
        return {p: i + 1 for i, p in enumerate(self.participants)}

    def to_json(self) -> str:
        """JSON form for the wire (the seed as hex)."""
        return json.dumps({"round_id": self.round_id, "participants": list(self.participants),
                           "vector_length": self.vector_length, "clip": self.clip, "max_weight": self.max_weight,
                           "neighbours": self.neighbours, "threshold": self.threshold,
                           "graph_seed": self.graph_seed.hex()})

    @classmethod
    def from_json(cls, text: str) -> "RoundParams":
        """Parse and validate what :meth:`to_json` wrote; SecAggError on anything malformed."""
        try:
            d = json.loads(text)
            params = cls(int(d["round_id"]), tuple(d["participants"]), int(d["vector_length"]), float(d["clip"]),
                         int(d["max_weight"]), int(d["neighbours"]), int(d["threshold"]),
                         bytes.fromhex(d["graph_seed"]))
            params.validate()
        except SecAggError:
            raise
        # OverflowError: 1e400 is inf; RecursionError: deeply nested arrays; TypeError: unhashable participants
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            raise SecAggError(f"malformed secure-aggregation settings: {exc}") from None
        return params
