"""The collectives that join aggregator ranks (server/ranks/leader.py): rank 0's control messages, the check
that every rank is there, the all-reduce of the partial sums and the broadcast of the new model.

Control messages are RankBroadcast protobuf messages (server/ranks/messages.py; never pickle) broadcast from rank 0
as byte tensors over a gloo group, so they work the same on CPU and GPU nodes; the sums travel over the default
group (NCCL when each rank has a GPU). Every call blocks: the ranks make them from one thread each, in the same
order.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from fedpar.aggregation.accumulator import ShapesAndDtypes, WeightedSum
from fedpar.aggregation.strategy import FoldItem, Strategy
from fedpar.aggregation.distributed import all_reduce_weighted_sum
from fedpar.parallel.device import backend_for, resolve_device
from fedpar.parallel.init import exit_rank_process, init_distributed
from fedpar.parallel.restarts import NAMESPACE_ENV, REPLACEMENT_ENV
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.server.ranks.messages import decode, encode


log = logging.getLogger("fedpar.server")
HOST_BYTES = 255
REFORM_KEY = "fedpar/ranks/reformed"  # + /N: the ranks of the group's N-th re-forming
JOIN_KEY = "fedpar/ranks/joining"  # + /R: a replacement for lost rank R asks to be taken back ("NONCE PORT PORT HOST")
ADMIT_KEY = "fedpar/ranks/admitted"  # + /R/NONCE: the re-forming (its N) that took that replacement back
# + /N: set by rank 0 once the rounds of a service's N-th run are done (0: the one run of a one-shot serve): a
# replacement still waiting to be taken back in that run leaves it
STOPPED_KEY = "fedpar/ranks/stopped"
ARRIVAL_POLL_SECONDS = 0.02  # how often a rank forming the group looks whether every member came
# + /R/NONCE: a replacement's count, up every ALIVE_EVERY_SECONDS while it asks and while it joins the group: it sends
# no heartbeat before its start message, and rank 0 must tell a hung or dead one from a slow one
ALIVE_KEY = "fedpar/ranks/alive"
ALIVE_EVERY_SECONDS = 0.25
JOINER_SILENT_SECONDS = 3.0  # a replacement whose count stood still this long while taken back died or hung
BROADCAST_BUCKET_BYTES = 4 << 20  # a model's small tensors go to the other ranks together, this much at a time
# A control message's first bytes go with its length in one broadcast, the rest (a round of hundreds of agents on
# other ranks) in a second: a round's three messages cost three broadcasts, not six (each a loopback round trip)
MESSAGE_HEAD_BYTES = 16 << 10
CLIENT_ID_BYTES = 512  # a handed-on update's client id, UTF-8 (agent ids are at most 128 characters)


class RankMissing(RuntimeError):
    """A rank did not take part in a collective in time (it died or hangs); the message names it."""


class RankLeftOut(RankMissing):
    """This rank was declared lost (it died or hung) and the others re-formed the group without it."""


@dataclass(frozen=True)
class RankEndpoint:
    """Where one aggregator rank takes agents' downloads and uploads."""

    rank: int
    host: str  # what agents dial ("" = the host they dial for rank 0)
    grpc_port: int
    data_port: int  # 0: no data plane


class RankGroup:
    """This process's place among the aggregator ranks, and the collectives they share."""

    def __init__(self, timeout_seconds: float, namespace: str | None = None):
        """``namespace``: the run's own keys in the rendezvous store, which its launcher gives every rank and the
        replacements of lost ones (None: the group's own prefix, which a replacement cannot know: under torchrun)."""
        if not dist.is_initialized():
            raise RuntimeError("aggregator ranks need torch.distributed initialized (init_distributed)")
        store = dist.distributed_c10d._get_default_store()
        if namespace is not None:
            store = dist.PrefixStore(namespace, base_store(store))
        self._setup(dist.get_rank(), dist.get_world_size(), dist.get_backend(), store, timeout_seconds)
        self.members = list(range(self.world))  # the ranks in the group now (rank 0 first), as dist ranks 0..
        self.control = dist.new_group(backend="gloo", timeout=self.timeout) if self.nccl else dist.group.WORLD

    @classmethod
    def replacement(cls, rank: int, world: int, host: str, port: int, namespace: str, timeout_seconds: float,
                    backend: str = "gloo") -> "RankGroup":
        """A fresh process for lost rank ``rank`` of ``world``, whose group met at the rendezvous store on
        ``host:port`` under ``namespace``: not in the group until rank 0 takes it back (:meth:`ask_to_join`)."""
        group = cls.__new__(cls)
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_seconds))
        group._setup(rank, world, backend, dist.PrefixStore(namespace, store), timeout_seconds)
        group.members, group.control = [], None
        return group

    def _setup(self, rank: int, world: int, backend: str, store, timeout_seconds: float) -> None:
        self.rank, self.world = rank, world  # as started: ranks keep their numbers
        self.generation = 0  # how many times the group was re-formed (without lost ranks, or with replacements)
        self.run = 0  # which of a service's runs the group serves (0: a one-shot serve's one run)
        self.timeout = timedelta(seconds=timeout_seconds)
        self.backend = backend
        self.nccl = self.backend == "nccl"
        # the rendezvous store the group was made with (rank 0's, or torchrun's): re-formed groups meet there
        self.store = store
        # where this rank keeps its partial sum: its GPU under NCCL (uploads go there from pinned staging), else host
        self.fold_device = f"cuda:{torch.cuda.current_device()}" if self.nccl else "host"
        self._owner: int | None = None  # the thread whose collectives run (None: any, until one claims the group)
        self._nonce = ""  # a replacement's, while it asks to be taken back and joins (its ALIVE_KEY count's)
        self._beat_at = 0.0  # when it last counted up

    def claim(self, thread_id: int | None) -> None:
        """Thread ``thread_id`` alone makes this group's collectives from now on: one a step was given up in (it
        waited for a lost rank) fails its next collective at once, instead of running it on the group formed again
        without that rank."""
        self._owner = thread_id

    def _check_owner(self, what: str) -> None:
        if self._owner is not None and threading.get_ident() != self._owner:
            raise RankMissing(f"{what} on aggregator rank {self.rank}: its step was given up (a rank was lost)")

    def reformed(self) -> bool:
        """Whether rank 0 formed the group again since this rank joined it (a step waiting for a lost rank then
        waits in vain)."""
        try:
            return self.store.check([f"{REFORM_KEY}/{self.generation + 1}"])
        except RuntimeError:  # the store is gone: the step in progress fails by itself
            return False

    @property
    def replacing(self) -> bool:
        """Whether this is a replacement rank not yet taken back into the group."""
        return not self.members

    def _index(self, rank: int) -> int:
        """The torch.distributed rank of aggregator rank ``rank`` in the group as it is now."""
        return self.members.index(rank)

    # --------------------------------------------------------------- re-forming
    def reform(self, members: Sequence[int], taken_back: dict[int, str] | None = None) -> None:
        """Rank 0: leave the group and form it again over ``members`` (the ranks still alive, 0 first, and the
        replacements ``taken_back``, by rank, with the nonce each asked with): leaving wakes every rank still waiting
        in a collective, which then rejoins (:meth:`rejoin`) if it is a member."""
        assert self.rank == 0 and members[0] == 0
        self.leave()
        self.generation += 1
        self._in_store("set", f"{REFORM_KEY}/{self.generation}", ",".join(str(r) for r in members).encode())
        for rank, nonce in (taken_back or {}).items():
            self._in_store("delete_key", f"{JOIN_KEY}/{rank}")
            self._in_store("set", f"{ADMIT_KEY}/{rank}/{nonce}", str(self.generation).encode())
        try:
            self._join(members, taken_back or {})
        finally:  # their counts told what they could: a service's store does not keep one per take-back
            for rank, nonce in (taken_back or {}).items():
                self._in_store("delete_key", f"{ALIVE_KEY}/{rank}/{nonce}")

    def _in_store(self, op: str, *args):
        """``op`` on the rendezvous store; RankMissing if the store is gone (its host died: rank 0's process, or
        torchrun's agent), as the group can then never be formed again."""
        try:
            return getattr(self.store, op)(*args)
        except RuntimeError as exc:  # DistStoreError
            raise RankMissing(f"the rendezvous store of the aggregator ranks is gone ({first_line(exc)}); their "
                              "group cannot be formed again") from None

    def asking_to_join(self) -> dict[int, tuple[str, RankEndpoint]]:
        """Rank 0: the replacement ranks that asked to be taken back (not in the group), with the nonce each asked
        with and where it takes agents."""
        asking = {}
        for rank in range(1, self.world):
            key = f"{JOIN_KEY}/{rank}"
            if rank not in self.members and self._in_store("check", [key]):
                nonce, grpc_port, data_port, host = self._in_store("get", key).decode().split(" ", 3)
                asking[rank] = (nonce, RankEndpoint(rank, host, int(grpc_port), int(data_port)))
        return asking

    def forget_asking(self, rank: int) -> None:
        """Rank 0: drop ``rank``'s request to be taken back (its replacement process ended while it asked)."""
        self._in_store("delete_key", f"{JOIN_KEY}/{rank}")

    def ask_to_join(self, mine: RankEndpoint) -> None:
        """A replacement rank: ask rank 0 to take it back (with its endpoint ``mine``) and join the group once rank 0
        formed it again with this rank, at a round's opening (asking again if that forming fails: another rank was
        lost meanwhile); RankMissing if the rounds end (or rank 0 and its store are gone) first."""
        first = True
        while True:
            members, first = self._admitted(mine, first), False
            try:
                self._join(members)
                self._forget_count()  # in the group: its heartbeats say it is alive from now on
                return
            except RankMissing as exc:
                log.info("%s; aggregator rank %d asks to be taken back again", exc, self.rank)

    def _admitted(self, mine: RankEndpoint, first: bool) -> list[int]:
        """Ask to be taken back (saying so the ``first`` time), and wait until rank 0 formed the group with this rank:
        its members."""
        self._forget_count()  # of a take-back that failed
        nonce = self._nonce = secrets.token_hex(8)
        admitted = f"{ADMIT_KEY}/{self.rank}/{nonce}"
        try:
            self._beat_at = 0.0
            self._beat()  # counted before it asks: rank 0 may take it back at once
            self.store.set(f"{JOIN_KEY}/{self.rank}", f"{nonce} {mine.grpc_port} {mine.data_port} {mine.host}".encode())
            if first:
                log.info("aggregator rank %d (pid %d) started again: waiting for rank 0 to take it back when a round "
                         "opens", self.rank, os.getpid())
            while not self.store.check([admitted]):
                if self.store.check([self._stopped_key]):
                    self.store.delete_key(f"{JOIN_KEY}/{self.rank}")  # asked again, if at all, in the next run
                    raise RankMissing(f"aggregator rank {self.rank}: the rounds ended before rank 0 took this "
                                      "replacement back")
                self._beat()
                time.sleep(0.1)
            self.generation = int(self.store.get(admitted).decode())
            return [int(r) for r in self.store.get(f"{REFORM_KEY}/{self.generation}").decode().split(",")]
        except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError: rank 0 and its store are gone
            if isinstance(exc, RankMissing):
                raise
            raise RankMissing(f"aggregator rank {self.rank}: rank 0 did not take this replacement back "
                              f"({first_line(exc)})") from None

    def stopped(self) -> None:
        """Rank 0, once the rounds of the run are done: a replacement rank still asking to be taken back leaves."""
        self._in_store("set", self._stopped_key, b"1")

    def run_stopped(self, run: int) -> bool:
        """Whether rank 0 is done with the rounds of the service's run ``run``."""
        return self._in_store("check", [f"{STOPPED_KEY}/{run}"])

    @property
    def _stopped_key(self) -> str:
        return f"{STOPPED_KEY}/{self.run}"

    def rejoin(self) -> None:
        """Ranks > 0, after a failed collective: wait for rank 0 to re-form the group and join it (RankLeftOut if
        rank 0 left this rank out, RankMissing if it did not re-form the group within a few timeouts)."""
        self.leave()
        while True:
            key = f"{REFORM_KEY}/{self.generation + 1}"
            try:
                self.store.wait([key], 3 * self.timeout)
                members = [int(r) for r in self.store.get(key).decode().split(",")]
            except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
                raise RankMissing(f"aggregator rank {self.rank}: rank 0 did not re-form the group of aggregator "
                                  f"ranks ({first_line(exc)})") from None
            self.generation += 1
            if self.rank not in members:
                raise RankLeftOut(f"aggregator rank {self.rank} was declared lost (it died or hung) and the other "
                                  "ranks went on without it")
            try:
                self._join(members)
                return
            except RankMissing:  # another member was lost meanwhile: rank 0 forms the group again
                continue

    def leave(self) -> None:
        """Leave the group (every rank still waiting in one of its collectives then fails at once)."""
        self.control = None  # the last reference: the group's connections close with it
        if dist.is_initialized():
            dist.destroy_process_group()

    def _forget_count(self) -> None:
        """A replacement: drop its ALIVE_KEY count (it joined, or asks again under another nonce)."""
        if self._nonce:
            self._in_store("delete_key", f"{ALIVE_KEY}/{self.rank}/{self._nonce}")
            self._nonce = ""

    def _beat(self) -> None:
        """A replacement asking or joining: count up its ALIVE_KEY, at most every ALIVE_EVERY_SECONDS."""
        now = time.monotonic()
        if self._nonce and now - self._beat_at >= ALIVE_EVERY_SECONDS:
            self._beat_at = now
            self._in_store("add", f"{ALIVE_KEY}/{self.rank}/{self._nonce}", 1)

    def _join(self, members: Sequence[int], joining: dict[int, str] | None = None) -> None:
        self._check_owner("forming the group")
        self._all_arrive(members, joining or {})
        self.leave()  # a group a given-up step formed meanwhile (it leaves it alone: see below) is not this one
        store = dist.PrefixStore(f"{REFORM_KEY}/{self.generation}/group", self.store)
        try:
            dist.init_process_group(self.backend, store=store, rank=members.index(self.rank),
                                    world_size=len(members), timeout=self.timeout)
            self.control = dist.new_group(backend="gloo", timeout=self.timeout) if self.nccl else dist.group.WORLD
        except RuntimeError as exc:  # a member that was to join did not (it died meanwhile), or the store is gone
            failure = first_line(exc)
            self._in_store("check", [f"{REFORM_KEY}/{self.generation}"])  # the store's own line, if it is what failed
            raise RankMissing(f"re-forming the group of aggregator ranks {list(members)} failed on rank {self.rank} "
                              f"({failure})") from None
        self._check_owner("forming the group")  # given up meanwhile: the group is the new owner's to form again
        self.members = list(members)

    def _all_arrive(self, members: Sequence[int], joining: dict[int, str]) -> None:
        """Wait until every member of this generation's group came to form it, asking between looks whether to stop
        waiting: rank 0's step given up by its leader (a rank was lost meanwhile) or because a replacement it takes
        back (``joining``: by rank, the nonce it asked with) stopped counting up (:meth:`_joiner_silent`), another
        rank's once rank 0 formed the group again without waiting for this one. A wait inside torch's own rendezvous
        could be left only at its timeout (--aggregator-timeout), and a thread left there could later form a group no
        one owns."""
        arrived = f"{REFORM_KEY}/{self.generation}/arrived"
        self._in_store("add", arrived, 1)
        start = looked = time.monotonic()
        end, counts = start + self.timeout.total_seconds(), {rank: (-1, start) for rank in joining}
        while int(self._in_store("add", arrived, 0)) < len(members):
            self._check_owner("forming the group")
            self._beat()
            if self.rank != 0 and self.reformed():
                raise RankMissing(f"aggregator rank {self.rank}: rank 0 formed the group again while this rank "
                                  "waited for the others to form it")
            if time.monotonic() > end:
                raise RankMissing(f"re-forming the group of aggregator ranks {list(members)} failed on rank "
                                  f"{self.rank}: not every member came within {self.timeout.total_seconds():g} s")
            if joining and time.monotonic() - looked >= ALIVE_EVERY_SECONDS:
                looked = time.monotonic()
                self._joiner_silent(joining, counts)
            time.sleep(ARRIVAL_POLL_SECONDS)

    def _joiner_silent(self, joining: dict[int, str], counts: dict[int, tuple[int, float]]) -> None:
        """Rank 0 taking back ``joining`` (by rank, the nonce each asked with): RankMissing once one's ALIVE_KEY count
        stood still for JOINER_SILENT_SECONDS (it hung or died: the process it asked from ended, or was stopped);
        ``counts``: each one's last count and when it changed."""
        now = time.monotonic()
        for rank, nonce in joining.items():
            count, since = counts[rank]
            seen = int(self._in_store("add", f"{ALIVE_KEY}/{rank}/{nonce}", 0))
            if seen != count:
                counts[rank] = (seen, now)
            elif now - since > JOINER_SILENT_SECONDS:  # (its request went at the take-back: a live one asks again)
                raise RankMissing(f"aggregator rank {rank}'s replacement did not come to form the group: silent for "
                                  f"{now - since:.1f} s (it died or hung)")

    # --------------------------------------------------------------- control messages
    def send(self, message: pb.RankBroadcast) -> None:
        """Rank 0: broadcast ``message`` to every rank (RankMissing if one is gone). A tick then waits for every rank
        (RankMissing naming those that are not there): it is how rank 0 finds a hung rank while it waits."""
        assert self.rank == 0
        self._broadcast_bytes(encode(message))
        if message.HasField("tick"):
            self.all_present("rank 0's tick")

    def receive(self) -> pb.RankBroadcast:
        """Ranks > 0: the next message rank 0 sent (RankMessageError if it is not a whole RankBroadcast)."""
        message = decode(pb.RankBroadcast, self._broadcast_bytes(None), "rank 0")
        if message.HasField("tick"):
            self.all_present("rank 0's tick")
        return message

    def _broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None): its length and first MESSAGE_HEAD_BYTES in one
        broadcast (a round's control messages fit), the rest, if any, in a second."""
        head = torch.zeros(8 + MESSAGE_HEAD_BYTES, dtype=torch.uint8)
        if data is not None:
            head[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
            if data:
                head[8:8 + min(len(data), MESSAGE_HEAD_BYTES)] = torch.frombuffer(
                    bytearray(data[:MESSAGE_HEAD_BYTES]), dtype=torch.uint8)
        self._collective("broadcast", dist.broadcast, head, src=0, group=self.control)
        size = int.from_bytes(head[:8].numpy().tobytes(), "little")
        if size <= MESSAGE_HEAD_BYTES:
            return head[8:8 + size].numpy().tobytes()
        rest = torch.frombuffer(bytearray(data[MESSAGE_HEAD_BYTES:]), dtype=torch.uint8) if data is not None \
            else torch.empty(size - MESSAGE_HEAD_BYTES, dtype=torch.uint8)
        self._collective("broadcast", dist.broadcast, rest, src=0, group=self.control)
        return head[8:].numpy().tobytes() + rest.numpy().tobytes()

    def all_present(self, where: str) -> None:
        """Return once every rank reached this point; RankMissing naming the ranks that did not, within the timeout."""
        self._check_owner(where)
        try:
            dist.monitored_barrier(group=self.control, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as exc:
            raise RankMissing(f"aggregator rank(s) missing at {where}: {first_line(exc)}") from None

    def exchange_endpoints(self, mine: RankEndpoint) -> list[RankEndpoint]:
        """Every rank's endpoint, by rank (each rank passes its own): the group's first collective, which may wait
        for the start-up's timeout; every later one fails after the configured one."""
        host = mine.host.encode()[:HOST_BYTES]
        row = torch.zeros(HOST_BYTES + 3, dtype=torch.int64)
        row[0], row[1], row[2] = len(host), mine.grpc_port, mine.data_port
        row[3:3 + len(host)] = torch.tensor(list(host), dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in self.members]
        self._collective("all-gather", dist.all_gather, rows, row, group=self.control)
        self._time_out_as_configured()
        return [RankEndpoint(r, bytes(t[3:3 + int(t[0])].tolist()).decode(), int(t[1]), int(t[2]))
                for r, t in zip(self.members, rows)]

    def _time_out_as_configured(self) -> None:
        """From now on every collective of the group fails after the configured timeout: the group was joined with
        the start-up's longer one (ranks import torch and load their data before their first collective), which a
        rank that hangs later would otherwise hold every other rank in a collective for."""
        for group in {self.control, dist.group.WORLD}:
            dist.distributed_c10d._set_pg_timeout(self.timeout, group)

    # --------------------------------------------------------------- data
    def gather_floats(self, values: Sequence[float]) -> dict[int, list[float]]:
        """Every member's ``values`` (same length everywhere), by rank."""
        mine = torch.tensor(list(values), dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in self.members]
        self._collective("all-gather", dist.all_gather, out, mine, group=self.control)
        return {r: t.tolist() for r, t in zip(self.members, out)}

    def gather_updates(self, items: Sequence[FoldItem], shapes: ShapesAndDtypes,
                       counts: dict[int, int]) -> list[FoldItem]:
        """Rank 0: every other rank's ``items`` (whole updates of the model ``shapes`` describes, their weights and
        client ids; ``counts``: how many each rank sends), in rank order; the other ranks send theirs and get [].
        Memory at rank 0: the updates sent."""
        if self.rank:
            for item in items:
                for a in shapes.check(item.update, "a handed-on update"):
                    self._collective("send", dist.send, torch.from_numpy(np.ascontiguousarray(a).ravel()), 0,
                                     group=self.control)
                name = item.client_id.encode()[:CLIENT_ID_BYTES].ljust(CLIENT_ID_BYTES, b"\0")
                name = torch.frombuffer(bytearray(name), dtype=torch.uint8)
                self._collective("send", dist.send, name, 0, group=self.control)
                self._collective("send", dist.send, torch.tensor([float(item.num_examples)], dtype=torch.float64),
                                 0, group=self.control)
            return []
        out = []
        for r in self.members[1:]:
            for _ in range(counts[r]):
                update = []
                for shape, dtype, size in zip(shapes.shapes, shapes.dtypes, shapes.sizes):
                    buf = np.empty(size, dtype)
                    self._collective("receive", dist.recv, torch.from_numpy(buf), self._index(r),
                                     group=self.control)
                    update.append(buf.reshape(shape))
                name = torch.empty(CLIENT_ID_BYTES, dtype=torch.uint8)
                weight = torch.empty(1, dtype=torch.float64)
                self._collective("receive", dist.recv, name, self._index(r), group=self.control)
                self._collective("receive", dist.recv, weight, self._index(r), group=self.control)
                client_id = bytes(name.tolist()).rstrip(b"\0").decode(errors="replace")
                out.append(FoldItem(update, float(weight[0]), client_id))
        return out

    def combine(self, strategy: Strategy, shapes: ShapesAndDtypes, stats: Sequence[float],
                gathered: Callable[[], None] = lambda: None) -> dict[int, list[float]]:
        """Every rank at a round's close (the same calls everywhere): every rank's ``stats`` (the same length
        everywhere) gathered with its strategy's counts and how many updates it hands on, in one all-gather, which
        fails, changing nothing, if a rank is gone (``gathered`` is called once it went through: every rank is there
        and the sums start to move); the partial sums added up; rank 0's strategy given the other ranks' counts and
        the updates they hand on (``shapes``: the model's). Returns each rank's ``stats``."""
        counts, items = strategy.partial_counts(), strategy.handoff() if self.rank else []
        rows = self.gather_floats([*stats, *counts, float(len(items))])
        gathered()
        partial = strategy.partial_sum()
        if partial is not None:
            self.sum_partials(partial)
        if counts and self.rank == 0:
            strategy.merge_counts([v[len(stats):len(stats) + len(counts)] for r, v in rows.items() if r])
        handed = self.gather_updates(items, shapes, {r: int(v[-1]) for r, v in rows.items()})
        if self.rank == 0:
            strategy.take_handoff(handed)
        return {r: v[:len(stats)] for r, v in rows.items()}

    def sum_partials(self, acc: WeightedSum) -> None:
        """Add up every rank's partial weighted sum in place (each rank then holds the round's total)."""
        self._collective("all-reduce", all_reduce_weighted_sum, acc, group=None)

    def broadcast_arrays(self, arrays: Sequence[np.ndarray]) -> None:
        """Rank 0's ``arrays`` into every rank's arrays of the same shapes and dtypes (in place; C-contiguous on
        ranks > 0): the small ones end to end in buckets of up to BROADCAST_BUCKET_BYTES (one collective each, not one
        per tensor), a larger one alone. Every rank cuts the same buckets: they follow from the shapes alone."""
        bucket: list[np.ndarray] = []
        filled = 0
        for a in arrays:
            if self.rank and not a.flags.c_contiguous:  # a strided array's reshape would be a copy, filled in vain
                raise ValueError("broadcast_arrays fills C-contiguous arrays in place")
            if a.nbytes >= BROADCAST_BUCKET_BYTES:
                self._broadcast_bytes_of([a])
                continue
            if filled + a.nbytes > BROADCAST_BUCKET_BYTES:
                self._broadcast_bytes_of(bucket)
                bucket, filled = [], 0
            bucket.append(a)
            filled += a.nbytes
        if bucket:
            self._broadcast_bytes_of(bucket)

    def _broadcast_bytes_of(self, arrays: list[np.ndarray]) -> None:
        """One broadcast of ``arrays``' bytes from rank 0 (one array: in place; several: through one buffer)."""
        views = [a.reshape(-1).view(np.uint8) for a in arrays]
        flat = views[0] if len(views) == 1 else \
            np.concatenate(views) if self.rank == 0 else np.empty(sum(v.size for v in views), np.uint8)
        t = torch.from_numpy(flat)
        if self.nccl:
            dev = t.cuda()
            self._collective("broadcast", dist.broadcast, dev, src=0)
            t.copy_(dev.cpu())
        else:
            self._collective("broadcast", dist.broadcast, t, src=0)
        if len(views) > 1 and self.rank != 0:
            offset = 0
            for v in views:
                v[:] = flat[offset:offset + v.size]
                offset += v.size

    def _collective(self, what: str, fn, *args, **kwargs):
        self._check_owner(what)
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:  # a peer died (connection closed) or the timeout passed
            who = "rank 0 (the control plane)" if self.rank else "an aggregator rank"
            raise RankMissing(f"{what} among {self.world} aggregator ranks failed on rank {self.rank}: {who} is gone "
                              f"or hangs ({first_line(exc)})") from None


def launched_group(timeout_seconds: float, device: str) -> RankGroup:
    """This process's place among the aggregator ranks as its launcher started it (torchrun, or `serve`'s own): a
    rank of the group, or the replacement of a lost rank (parallel/restarts.py), which rank 0 takes back later."""
    namespace = os.environ.get(NAMESPACE_ENV)
    if os.environ.get(REPLACEMENT_ENV) != "1" or namespace is None:
        init_distributed(timeout_seconds, device)
        return RankGroup(timeout_seconds, namespace)
    rank = int(os.environ["RANK"])
    torch_device = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    try:
        return RankGroup.replacement(rank, int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"],
                                     int(os.environ["MASTER_PORT"]), namespace, timeout_seconds,
                                     backend_for(torch_device))
    except RuntimeError as exc:  # rank 0 and its rendezvous store are gone: nothing to rejoin
        log.info("aggregator rank %d: not started again: rank 0's rendezvous store is gone (%s)", rank, first_line(exc))
        exit_rank_process(0)
        raise


def base_store(store: dist.Store) -> dist.Store:
    """The rendezvous store under ``store``'s prefixes: where a replacement rank, which connects to it alone, meets
    the group."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text (torch's carry C++ stack traces after it)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
