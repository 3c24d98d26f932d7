"""Many members that do not train, hosted by one client runtime (client/runtime.py): the clients of the load test,
the kill -9 test and the restart benchmark, against a coordinator serving a synthetic model.

Each member's "training" adds a little noise to the round's global weights (numpy, no torch), so a process hosts
thousands. Everything else is the runtime a deployed agent or a simulation worker runs: JoinPopulation, the pull
long-poll, the round's download, the upload and its retries, re-joining a restarted coordinator, backing off while
it is down. Run it as a script (the coordinator must accept populations):

    python tests/support/synthetic_members.py --server HOST:PORT --count N --params P

It prints what the members did as one JSON line and exits 0 once the coordinator said training is over.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
import zlib
from dataclasses import asdict

import numpy as np

from fedpar.client.links import AgentConfig
from fedpar.client.local_loop import TrainResult
from fedpar.client.runtime import ClientRuntime
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.server.assembly import synthetic_model

EXAMPLES = 100  # what each member says it holds, and the weight of its update


class NoiseTrainer:
    """A seat's trainer: the global weights plus N(0, 0.01) noise, drawn from the member's own stream."""

    framework = "torch"
    reads_task_settings = False
    evaluates_together = False
    survives_failed_training = True
    num_examples = EXAMPLES

    def __init__(self, names: list[str], arrays: list[np.ndarray]):
        self.specs = [(n, a.dtype.name, a.shape) for n, a in zip(names, arrays)]
        self.arrays: list[np.ndarray] = []
        self.rng = np.random.default_rng(0)

    def array_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """What the model holds."""
        return self.specs

    def set_arrays(self, arrays: list[np.ndarray]) -> None:
        """The round's global weights."""
        self.arrays = [np.array(a) for a in arrays]

    def get_arrays(self) -> list[np.ndarray]:
        """The "trained" weights."""
        return self.arrays

    def use_member(self, seed: int) -> None:
        """Draw the next noise from this member's stream."""
        self.rng = np.random.default_rng(seed)

    def warm_up(self) -> None:
        """Nothing to warm."""

    def holding_task(self, round_id: int) -> contextlib.AbstractContextManager:
        """Nothing held."""
        return contextlib.nullcontext()

    def tasks_queued(self, round_id: int, count: int) -> None:
        """Nothing waits for them."""

    def call_off(self) -> None:
        """Nothing waits."""

    def evaluate(self) -> None:
        """No validation data."""
        return None

    def evaluate_splits(self, splits: list) -> list[None]:
        """No validation data, for any member."""
        return [None] * len(splits)

    def train(self, epochs: int, batch_size: int, lr: float, stop_at: float = math.inf, **_) -> TrainResult:
        """Add the noise."""
        self.arrays = [a + self.rng.standard_normal(a.shape).astype(a.dtype) * a.dtype.type(0.01)
                       if a.dtype.kind == "f" else a for a in self.arrays]
        return TrainResult(steps=1, examples=EXAMPLES, loss=math.nan, stopped_early=False, seconds=0.0)


class SyntheticMembers:
    """Members ``PREFIX-FIRST`` ... of a population that is always online and never drops out."""

    population = True
    answers_messages = False

    def __init__(self, prefix: str, first: int, count: int, params: int):
        self.prefix, self.first, self.count = prefix, first, count
        self.model = synthetic_model(params)

    def __len__(self) -> int:
        return self.count

    def member_id(self, i: int) -> str:
        """``PREFIX-00042``."""
        return f"{self.prefix}-{self.first + i:05d}"

    def index_of(self, member: str) -> int:
        """The index of ``PREFIX-NNNNN`` among these members (KeyError: not one of them)."""
        prefix, _, number = member.rpartition("-")
        i = int(number) - self.first if prefix == self.prefix and number.isdigit() else -1
        if not 0 <= i < self.count:
            raise KeyError(f"{member!r} is not one of these members")
        return i

    def train_size(self, i: int) -> int:
        """Every member holds EXAMPLES."""
        return EXAMPLES

    def seat_trainers(self, seats: int) -> list:
        """Noise trainers for the synthetic model."""
        return [NoiseTrainer(*self.model) for _ in range(seats)]

    def assign(self, trainer: NoiseTrainer, i: int, task: pb.TrainTask) -> None:
        """The member's own noise."""
        trainer.use_member(zlib.crc32(f"{self.member_id(i)}:{task.round}".encode()))

    def vanishes(self, i: int, round_id: int) -> bool:
        """Never."""
        return False

    def joining(self, start: int, stop: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Members ``start``..``stop - 1``: their ids, EXAMPLES each, none away."""
        return ([self.member_id(i) for i in range(start, stop)], np.full(stop - start, EXAMPLES, np.int64),
                np.zeros(stop - start, bool))

    def availability_changes(self, clock_seconds: float | None) -> tuple[list[str], list[str]]:
        """None."""
        return [], []

    def finish_estimate(self, i: int, task: pb.TrainTask) -> float:
        """At once."""
        return 0.0


def main(argv: list[str] | None = None) -> int:
    """Command line: host the members until the coordinator says training is over; print their stats as JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--server", required=True, help="coordinator HOST:PORT")
    p.add_argument("--count", type=int, required=True, help="number of members")
    p.add_argument("--params", type=int, required=True, help="the coordinator's synthetic model size")
    p.add_argument("--prefix", default="member", help="member ids are PREFIX-00000, PREFIX-00001, ...")
    p.add_argument("--first", type=int, default=0, help="index of the first member id")
    p.add_argument("--seats", type=int, default=2, help="members trained at once")
    p.add_argument("--poll", type=float, default=5.0, help="long-poll seconds")
    p.add_argument("--max-backoff", type=float, default=1.0, help="longest reconnect wait")
    args = p.parse_args(argv)
    host = f"{args.prefix}-host-{args.first}"
    runtime = ClientRuntime(AgentConfig(server=args.server, agent_id=host, insecure=True, poll_seconds=args.poll,
                                        initial_backoff=0.05, max_backoff=args.max_backoff, seed=args.first),
                            SyntheticMembers(args.prefix, args.first, args.count, args.params), seats=args.seats)
    start = time.monotonic()
    stats = runtime.run()  # returns once the coordinator said training is over
    finished = args.count if runtime.shutdown_reason is not None else 0  # told that training is over, or stopped
    print(json.dumps({**asdict(stats), "members": args.count, "finished": finished,
                      "seconds": time.monotonic() - start}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
