"""Virtual clients: which members of a population a simulation worker hosts, and what each brings; the client
runtime (client/runtime.py) hosts them, and only the members sampled in a round get a model and their data, for
that round.

A population of N costs O(N) bytes here (a client's number, its number of examples, its speed) and in the
coordinator's arrays (server/member_table.py), never an agent, a thread, a record or a model copy each.
:class:`PopulationMembers` is the member source the runtime is given: its members' ids and examples, a member's data for
a seat (the task's ``client_data`` for its Partition, made then), its slow device, its drop-outs, its availability
(traces) and its simulated finish time (virtual clock). Joining, pulling, training, the update transforms and the upload
are the runtime's, as for a deployed agent; sampling, the deadline, first-K-of-M, validation and the fold stay the
coordinator's own, over real gRPC.

Under mutual TLS the runtime's connection carries the host's certificate, which speaks for its members (they have
none of their own); with client batching the seats train together as one batched model
(simulations/client_batching.py).
"""

from __future__ import annotations

import math
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedpar.client.backoff import MAX_BACKOFF_SECONDS
from fedpar.client.links import AgentConfig
from fedpar.client.local_loop import member_seed
from fedpar.client.runtime import ClientRuntime
from fedpar.client.task_trainer import TaskTrainer
from fedpar.datasets.clientdata import local_train_size
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import one_line
from fedpar.security.sslcontext import client_ssl_context
from fedpar.security.tls import TlsFiles, channel_credentials
from fedpar.simulations.client_batching import BatchedTrainer, ClientBatcher
from fedpar.task import (ClientData, Partition, Task, TaskError, check_training_data, checked_client_data,
                         is_task_failure, raised, steps_in_time)
from fedpar.tasks.data import in_memory
from fedpar.simulations.traces import (DAY_SECONDS, VIRTUAL_DAY, AvailabilityEvents, Traces, check_day_seconds, online,
                                       seconds_left_online)

# A worker keeps its recent members' data (in-memory datasets only) up to this many bytes: a member sampled again
# trains without its share being cut and split again (measured: a third of a digits member's local epoch).
MEMBER_DATA_CACHE_BYTES = 64 << 20
MAX_STEPS = 2**32 - 1  # TrainTask.max_steps is a uint32
VIRTUAL_STEP_SECONDS = 0.01  # virtual clock without a trace: a local step's simulated seconds (FedScale's median)


def step_delays(clients: int, slow_fraction: float, slow_step_delay: float, seed: int,
                traces: Traces | None = None) -> np.ndarray:
    """Seconds each client adds per local step: its trace's when there are ``traces``, else ``slow_step_delay`` for
    a random ``slow_fraction`` of them."""
    if traces is not None:
        return traces.seconds_per_step
    rng = np.random.default_rng(seed + 1)
    delays = np.zeros(clients, np.float32)
    delays[rng.choice(clients, size=int(round(slow_fraction * clients)), replace=False)] = slow_step_delay
    return delays


def _data_bytes(data: ClientData) -> int | None:
    """The bytes of ``data``'s in-memory tensors (None: a dataset not held in memory, never kept)."""
    total = 0
    for part in (data.train, data.val):
        if part is None:
            continue
        tensors = in_memory(part)
        if tensors is None:
            return None
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def client_id(number: int) -> str:
    """The id of client ``number`` of a simulated federation (agents and virtual clients alike)."""
    return f"client-{number:04d}"


@dataclass
class PopulationSlice:
    """The clients one host speaks for, compactly: their numbers, how many examples each holds (None: unknown
    until the host asks the task), the seconds each adds per local step (a slow device), and the drop chance per
    round."""

    host_id: str
    numbers: np.ndarray  # int64, the clients' numbers in the federation, ascending
    sizes: np.ndarray | None  # int64 per member: its examples, before its validation share is kept apart
    step_delays: np.ndarray  # float32 per member
    drop_probability: float = 0.0
    available_from: np.ndarray | None = None  # float32 per member: seconds into a trace day it comes online
    available_for: np.ndarray | None = None  # ... and for how long (None: always online)
    step_seconds: np.ndarray | None = None  # float32 per member: a local step's simulated seconds (virtual clock)
    download_mbps: np.ndarray | None = None  # float32 per member: link speeds (None: transfers take no time)
    upload_mbps: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.numbers)

    def away(self, day_seconds: float) -> np.ndarray:
        """Which members are offline ``day_seconds`` into the trace's day (none without availability)."""
        if self.available_from is None:
            return np.zeros(len(self), bool)
        return ~online(day_seconds, self.available_from, self.available_for)

    def work(self, i: int, steps: int, model_bytes: int, clock_seconds: float, deadline: float,
             dropped: bool) -> tuple[int, float]:
        """The local steps member ``i`` does of a task of ``steps`` on a model of ``model_bytes``, and the simulated
        seconds it needs (download, train, upload) from ``clock_seconds`` on; (0, -1) when it would not upload. It
        stops training when the client side's deadline rule says (fedpar/task.py), as a real agent does; so a
        slow uplink may still make it late. It does not upload when no step fits, when it drops out, or when its
        availability window closes before it is done."""
        step = float(self.step_seconds[i]) if self.step_seconds is not None \
            else VIRTUAL_STEP_SECONDS + float(self.step_delays[i])
        down = up = 0.0
        if self.download_mbps is not None:
            bits = 8.0 * model_bytes
            down, up = bits / (float(self.download_mbps[i]) * 1e6), bits / (float(self.upload_mbps[i]) * 1e6)
        done = steps_in_time(steps, step, down, deadline)
        seconds = down + done * step + up
        if self.available_from is not None:
            left = seconds_left_online(clock_seconds, self.available_from[i:i + 1], self.available_for[i:i + 1])[0]
            dropped = dropped or seconds > left
        return (0, -1.0) if dropped or done == 0 else (done, seconds)

    @staticmethod
    def of(host_id: str, numbers: np.ndarray, sizes: np.ndarray | None, step_delays: np.ndarray,
           drop_probability: float = 0.0, traces: Traces | None = None) -> PopulationSlice:
        """The slice of clients ``numbers`` (``sizes[n]``: client n's examples, for every client; None: the task's,
        unknown here; ``traces``: their availability)."""
        picked = np.asarray(numbers, np.int64)
        columns = (traces.available_from, traces.available_for, traces.seconds_per_step, traces.download_mbps,
                   traces.upload_mbps) if traces is not None else (None,) * 5
        return PopulationSlice(host_id, picked, None if sizes is None else np.asarray(sizes, np.int64)[picked],
                               np.asarray(step_delays, np.float32)[picked], drop_probability,
                               *(None if c is None else c[picked] for c in columns))



class PopulationMembers:
    """The member source a client runtime hosts a :class:`PopulationSlice` from (client/links.Population): member
    ``i`` trains ``task`` on ``task.client_data(partition_of(number, member_id))``, shuffled by its own seed, slowed
    by its step delay; it drops out by its own draw and is offline outside its trace's windows (by the
    coordinator's simulated time under a virtual clock, else ``day_seconds`` real seconds per trace day)."""

    population = True
    answers_messages = False

    def __init__(self, population: PopulationSlice, task: Task, partition_of: Callable[[int, str], Partition],
                 seed: int, device: str = "cpu", precision: str = "fp32", day_seconds: float = DAY_SECONDS,
                 client_batching: bool = False):
        self.pop, self.task, self.partition_of, self.seed = population, task, partition_of, seed
        self.device, self.precision, self.client_batching = device, precision, client_batching
        check_day_seconds(day_seconds)
        self.day_scale = DAY_SECONDS / day_seconds  # trace seconds per real second
        self.started = time.monotonic()
        self.offline = population.away(0.0)  # whom the coordinator knows as away
        self._offline_at = 0.0  # ... at this time of the trace
        self.events = AvailabilityEvents(population.available_from, population.available_for) \
            if population.available_from is not None else None
        self._data: OrderedDict[int, ClientData] = OrderedDict()  # recent members' data, least recent first
        self._data_bytes = 0
        self._data_lock = threading.Lock()  # the seats ask for their members' data side by side
        self.train_sizes = self._train_sizes()  # each member's training examples, for joining and the virtual clock

    def __len__(self) -> int:
        return len(self.pop)

    def member_id(self, i: int) -> str:
        """Member ``i``'s client id."""
        return client_id(int(self.pop.numbers[i]))

    def index_of(self, member: str) -> int:
        """The index of member ``member`` in the slice, found from the number its id carries (client_id) among the
        slice's ascending numbers: no table of ids held per member (KeyError: not one of its members' ids)."""
        digits = member.removeprefix("client-")
        number = int(digits) if digits.isascii() and digits.isdigit() else -1
        i = int(np.searchsorted(self.pop.numbers, number))
        if i >= len(self.pop) or self.pop.numbers[i] != number or client_id(number) != member:
            raise KeyError(f"{one_line(member, 64)!r} is not a member of {self.pop.host_id}")
        return i

    def member_data(self, i: int) -> ClientData:
        """Member ``i``'s data: the task's client_data for its Partition (kept from an earlier round while the
        recent members' in-memory data fits in MEMBER_DATA_CACHE_BYTES, as a deployed agent keeps its own)."""
        with self._data_lock:
            data = self._data.get(i)
            if data is not None:
                self._data.move_to_end(i)
                return data
        number = int(self.pop.numbers[i])
        try:
            data = self.task.client_data(self.partition_of(number, client_id(number)))
        except BaseException as exc:  # the task's own code: said as such, wherever asked for (start-up, a round)
            if not is_task_failure(exc):  # a Ctrl-C
                raise
            raise TaskError(f"the task's client_data raised {raised(exc)} for {client_id(number)}") from exc
        check_training_data(self.task.name, checked_client_data(data), client_id(number))
        size = _data_bytes(data)
        if size is not None and size <= MEMBER_DATA_CACHE_BYTES:
            with self._data_lock:
                if i not in self._data:
                    self._data[i], self._data_bytes = data, self._data_bytes + size
                while self._data_bytes > MEMBER_DATA_CACHE_BYTES:
                    self._data_bytes -= _data_bytes(self._data.popitem(last=False)[1])
        return data

    def validation(self, i: int):
        """Member ``i``'s validation split (None without one)."""
        return self.member_data(i).val

    def train_size(self, i: int) -> int:
        """Member ``i``'s training examples."""
        return int(self.train_sizes[i])

    def _train_sizes(self) -> np.ndarray:
        """Each member's training examples: from the slice's sizes when it has them (the zoo's, split as
        datasets/clientdata.local_split does), else counted in the task's data of each member, made once here."""
        if self.pop.sizes is not None:
            return local_train_size(self.pop.sizes, self.partition_of(0, client_id(0)).val_fraction)
        return np.asarray([len(self.member_data(i).train) for i in range(len(self.pop))], np.int64)

    def seat_trainers(self, seats: int) -> list:
        """``seats`` trainers of the task, the first member's data in each until a member takes one over (client
        batching: batched trainers meeting in one batcher); none for an empty slice."""
        if not len(self.pop):
            return []
        first = self.member_data(0)
        compute_lock = threading.Lock()  # the seats take turns on this process's CPU (see TaskTrainer)
        batcher = ClientBatcher(self.device, compute_lock) if self.client_batching else None
        trainers = []
        for _ in range(seats):
            torch.manual_seed(self.seed)
            if batcher is not None:
                trainers.append(BatchedTrainer(self.task, first, batcher, seed=self.seed, compute_lock=compute_lock,
                                               device=self.device))
            else:
                trainers.append(TaskTrainer(self.task, first, seed=self.seed, device=self.device,
                                            precision=self.precision, compute_lock=compute_lock))
        return trainers

    def assign(self, trainer, i: int, task: pb.TrainTask) -> None:
        """Train as member ``i``: its data, its seed, its slow device (under the virtual clock a slow device costs
        simulated time, not real pauses)."""
        trainer.use_data(self.member_data(i), member_seed(self.seed, self.member_id(i)),
                         0.0 if task.virtual_clock else float(self.pop.step_delays[i]))

    def vanishes(self, i: int, round_id: int) -> bool:
        """Offline now, or dropped out of round ``round_id`` (an offline or vanished device does not answer)."""
        return bool(self.offline[i]) or self.drops(i, round_id)

    def drops(self, i: int, round_id: int) -> bool:
        """Whether member ``i`` vanishes in round ``round_id``: its own draw, the same whichever host speaks for it."""
        if not self.pop.drop_probability:
            return False
        return np.random.default_rng([self.seed, int(self.pop.numbers[i]), round_id]).random() \
            < self.pop.drop_probability

    def joining(self, start: int, stop: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Members ``start``..``stop - 1`` as the coordinator is told of them at join: ids, training examples (at
        least 1), offline as it was last told (read from the arrays in one go: a host joins a million)."""
        return ([client_id(n) for n in self.pop.numbers[start:stop].tolist()],
                np.maximum(1, self.train_sizes[start:stop]), self.offline[start:stop])

    def availability_changes(self, clock_seconds: float | None) -> tuple[list[str], list[str]]:
        """Members that went offline and that came back since the last call, by the trace's clock: the
        coordinator's simulated time under a virtual clock, else one real second is ``day_scale`` trace seconds,
        from when this host started."""
        if clock_seconds is not None and self.day_scale != 1.0:  # simulate-workers against serve --clock virtual
            raise ValueError(VIRTUAL_DAY)
        day = clock_seconds if clock_seconds is not None else (time.monotonic() - self.started) * self.day_scale
        if self.events is None:
            return [], []
        maybe = self.events.between(self._offline_at, day)  # the others' windows neither opened nor closed
        self._offline_at = day
        now = ~online(day, self.pop.available_from[maybe], self.pop.available_for[maybe])
        changed = maybe[now != self.offline[maybe]]
        self.offline[changed] = ~self.offline[changed]
        ids = [(self.member_id(i), bool(self.offline[i])) for i in changed]
        return [m for m, gone in ids if gone], [m for m, gone in ids if not gone]

    def finish_estimate(self, i: int, task: pb.TrainTask) -> float:
        """Member ``i``'s simulated finish time for ``task`` under the virtual clock, from its trace and its real
        amount of work (the local steps of its data at the task's epochs and batch size that fit); -1: it would not
        upload. Caps ``task.max_steps`` at those steps."""
        steps = task.local_epochs * math.ceil(self.train_size(i) / max(1, task.batch_size))
        done, seconds = self.pop.work(i, steps, task.model_bytes, task.clock_seconds, task.clock_deadline_seconds,
                                      self.drops(i, task.round))
        task.max_steps = min(done, MAX_STEPS)  # a task of billions of steps would not fit its uint32 field
        return seconds


def host_population(server: str, population: PopulationSlice, task: Task | None,
                    partition_of: Callable[[int, str], Partition], seed: int, seats: int = 2,
                    poll_seconds: float = 2.0, device: str = "cpu", precision: str = "fp32",
                    day_seconds: float = DAY_SECONDS, max_backoff: float = MAX_BACKOFF_SECONDS,
                    give_up_after: float | None = None,
                    tls: TlsFiles | None = None, client_batching: bool = False,
                    members: PopulationMembers | None = None, task_name: str = "", tls_server_name: str | None = None,
                    enrollment_token: str = "", whole_population: int = 0) -> ClientRuntime:
    """A client runtime hosting ``population`` on ``seats`` seats against ``server``, as its host id (under mutual
    TLS: the host's certificate ``tls``, checking the coordinator's for ``tls_server_name`` when given; a coordinator
    that admits by token: ``enrollment_token``). Like an agent it outlives its coordinator: it backs off while the
    coordinator is unreachable (up to ``max_backoff`` seconds between tries; ``give_up_after`` seconds unreachable
    end it, None: never) and registers its members again when a restarted coordinator no longer knows its
    session. ``members``: the member source when it is not the task's (a Flower App's, with task None);
    ``task_name``: the task its members train, as it declares it when it joins (cli/task_options.py task_label);
    ``whole_population``: the population it hosts a slice of, declared too (a coordinator compares --min-available)."""
    credentials = channel_credentials(tls) if tls is not None else None
    config = AgentConfig(server=server, agent_id=population.host_id, poll_seconds=poll_seconds, max_backoff=max_backoff,
                         give_up_after=give_up_after, credentials=credentials, insecure=credentials is None,
                         tls_server_name=tls_server_name, enrollment_token=enrollment_token,
                         data_tls=client_ssl_context(tls) if tls is not None else None, tls_files=tls,
                         seed=zlib.crc32(f"{seed}:{population.host_id}".encode()), task=task_name,
                         population=whole_population)
    if members is None:
        members = PopulationMembers(population, task, partition_of, seed, device, precision, day_seconds,
                                    client_batching)
    return ClientRuntime(config, members, seats)
