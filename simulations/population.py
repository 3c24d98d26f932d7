"""Virtual clients: a simulation host process speaks for a slice of a population, and only the clients sampled in
a round get a model and their data, for that round.

A population of N costs O(N) bytes here (a client's number, its number of examples, its speed) and O(N) small
records in the coordinator, never an agent, a thread or a model copy each. The host registers its slice with
JoinPopulation (every member gets its own session), long-polls PullHostTasks for the tasks of whichever members
the coordinator sampled, and runs each task on one of a few *seats*: a real agent (client/agent.py) whose
trainer takes on the member's data for that task (the task's ``client_data`` for the member's Partition, made
then) and whose calls carry the member's session. Sampling, the
deadline, first-K-of-M, validation and the fold stay the coordinator's own, over real gRPC.

Under mutual TLS the host's connection carries the host's certificate, which speaks for its members (they have
none of their own); with client batching the seats train together as one batched model
(simulations/client_batching.py); in a secure round each member runs the client side of SecAgg+ here
(simulations/secure_members.py).
"""

from __future__ import annotations

import logging
import math
import queue
import random
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from fedpar.client.agent import UPLOAD_MARGIN_SECONDS, UPLOAD_TO_DOWNLOAD, Agent, AgentConfig
from fedpar.client.reconnect import Reconnecting
from fedpar.client.stats import AgentStats
from fedpar.client.task_trainer import TaskTrainer
from fedpar.datasets.clientdata import local_train_size
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.client.transfer import download_weights, task_weights
from fedpar.protocol.codec import CodecError
from fedpar.protocol.messages import PROTOCOL_VERSION, channel_options
from fedpar.protocol.task_settings import TaskSettings
from fedpar.protocol.stubs import CoordinatorStub
from fedpar.security.sslcontext import client_ssl_context
from fedpar.security.tls import TlsFiles, channel_credentials
from fedpar.simulations.client_batching import BatchedTrainer, ClientBatcher
from fedpar.simulations.host_uploads import HostUploads
from fedpar.simulations.secure_members import SecureMembers
from fedpar.simulations.member_state import ResidualStore
from fedpar.task import ClientData, Partition, Task
from fedpar.simulations.traces import DAY_SECONDS, AvailabilityEvents, Traces, online, seconds_left_online

log = logging.getLogger("fedpar.simulate")

JOIN_CHUNK = 5_000  # members registered per JoinPopulation call
# Seconds a host's upload batch waits for more updates after its first (the round's last ones go at once): a fifth
# of the margin a seat keeps free before the deadline. Each call costs both ends far more than its bytes (gRPC's
# per-call work); on a quiet machine 5, 20 and 50 ms gave the same 100-client digits round (0.08-0.09 s), on
# loaded cores 50 ms did best.
UPLOAD_LINGER = UPLOAD_MARGIN_SECONDS / 5
VIRTUAL_STEP_SECONDS = 0.01  # virtual clock without a trace: a local step's simulated seconds (FedScale's median)


def client_seed(seed: int, agent_id: str) -> int:
    """The shuffling seed of client ``agent_id`` in a run seeded ``seed`` (an agent's or a virtual client's)."""
    return seed + zlib.crc32(agent_id.encode()) % 10_000


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
        stops training as a real agent does (client/agent.py): in time to upload before ``deadline`` if its upload
        takes UPLOAD_TO_DOWNLOAD times its download, with UPLOAD_MARGIN_SECONDS to spare; so a slow uplink may
        still make it late. It does not upload when no step fits, when it drops out, or when its availability
        window closes before it is done."""
        step = float(self.step_seconds[i]) if self.step_seconds is not None \
            else VIRTUAL_STEP_SECONDS + float(self.step_delays[i])
        down = up = 0.0
        if self.download_mbps is not None:
            bits = 8.0 * model_bytes
            down, up = bits / (float(self.download_mbps[i]) * 1e6), bits / (float(self.upload_mbps[i]) * 1e6)
        stop_at = deadline - UPLOAD_TO_DOWNLOAD * down - UPLOAD_MARGIN_SECONDS
        fit = steps if step <= 0 else int(max(0.0, stop_at - down) // step)
        done = min(steps, fit)
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


class PopulationHost:
    """Registers a :class:`PopulationSlice` and runs its members' tasks on ``seats`` seats until training ends:
    ``task`` trained on each member's ``task.client_data(partition_of(number, member_id))``. Like an agent it outlives
    its coordinator: it backs off while the coordinator is unreachable (up to ``max_backoff`` seconds between tries;
    ``give_up_after`` seconds unreachable end it, None: never) and registers its members again when a restarted
    coordinator no longer knows its session."""

    def __init__(self, server: str, population: PopulationSlice, task: Task,
                 partition_of: Callable[[int, str], Partition], seed: int, seats: int = 2, poll_seconds: float = 2.0,
                 device: str = "cpu", precision: str = "fp32", day_seconds: float = DAY_SECONDS,
                 max_backoff: float = 30.0, give_up_after: float | None = None, tls: TlsFiles | None = None,
                 client_batching: bool = False):
        self.server, self.pop, self.task, self.partition_of = server, population, task, partition_of
        self.day_scale = DAY_SECONDS / day_seconds  # trace seconds per real second
        self.started = time.monotonic()
        self.offline = population.away(0.0)  # whom the coordinator knows as away
        self._offline_at = 0.0  # ... at this time of the trace
        self.events = AvailabilityEvents(population.available_from, population.available_for) \
            if population.available_from is not None else None
        self.clock_seconds: float | None = None  # the coordinator's simulated time, once it runs a virtual clock
        self._held: dict[str, tuple[int, pb.TrainTask]] = {}  # virtual clock: tasks waiting for the coordinator's go
        self._estimates: list[pb.FinishEstimate] = []  # virtual clock: finish times to report on the next call
        self.seed, self.poll_seconds = seed, poll_seconds
        credentials = channel_credentials(tls) if tls is not None else None
        self.channel = grpc.secure_channel(server, credentials, options=channel_options(64 << 20)) if credentials \
            else grpc.insecure_channel(server, options=channel_options(64 << 20))
        self.stub = CoordinatorStub(self.channel)
        self.host = pb.AgentAuth(agent_id=population.host_id)
        self.tokens: list[str] = []  # each member's session, by member index
        self.max_chunk = 0
        self._tasks: queue.Queue = queue.Queue()
        self._in_flight = 0  # members' tasks queued or training: their updates may still join the next batch
        self._in_flight_lock = threading.Lock()
        self.residuals: ResidualStore | None = None  # members' top-k error feedback, made by the first seat
        self._residuals_lock = threading.Lock()
        self._weights: tuple[int, list[np.ndarray] | None] = (-1, None)  # (round, its global model)
        self._weights_lock = threading.Lock()
        # an agent's rule (client/reconnect.py): back off while the coordinator is down, join again (every member
        # a new session) when it no longer knows this host's session, e.g. after it restarted
        self.calls = Reconnecting(population.host_id, server, self._join_all, 0.5, max_backoff,
                                  random.Random(zlib.crc32(f"{seed}:{population.host_id}".encode())), give_up_after)
        self.train_sizes = self._train_sizes()  # each member's training examples, for Join and the virtual clock
        compute_lock = threading.Lock()  # the seats take turns on this process's CPU (see TaskTrainer)
        batcher = ClientBatcher(device, compute_lock) if client_batching else None  # the seats' meeting point
        first = self.member_data(0) if len(population) else None
        self.seats = []
        for s in range(seats if first is not None else 0):
            torch.manual_seed(seed)
            if batcher is not None:
                trainer = BatchedTrainer(task.model(), first.train, first.val, batcher, seed=seed,
                                         compute_lock=compute_lock, device=device)
            else:
                trainer = TaskTrainer(task, first, seed=seed, device=device, precision=precision,
                                      compute_lock=compute_lock)
            self.seats.append(Agent(AgentConfig(server=server, agent_id=f"{population.host_id}-seat{s}",
                                                poll_seconds=poll_seconds, give_up_after=60.0,
                                                credentials=credentials, insecure=credentials is None,
                                                data_tls=client_ssl_context(tls) if tls is not None else None,
                                                tls_files=tls, seed=seed * 1_000_003 + s),
                                    trainer))  # the host draws the drops
        self.secure = SecureMembers(self.stub, poll_seconds)  # members' SecAgg+ client sides, in secure rounds

    def member_data(self, i: int) -> ClientData:
        """Member ``i``'s data: the task's client_data for its Partition."""
        number = int(self.pop.numbers[i])
        return self.task.client_data(self.partition_of(number, client_id(number)))

    def _train_sizes(self) -> np.ndarray:
        """Each member's training examples: from the slice's sizes when it has them (the zoo's, split as
        datasets/clientdata.local_split does), else counted in the task's data of each member, made once here."""
        if self.pop.sizes is not None:
            return local_train_size(self.pop.sizes, self.partition_of(0, client_id(0)).val_fraction)
        return np.asarray([len(self.member_data(i).train) for i in range(len(self.pop))], np.int64)

    def join(self) -> None:
        """Register every member (each gets its own session token), retried while the coordinator is unreachable."""
        self.calls.join()

    def _join_all(self) -> None:
        """A new session for the host and every member, JOIN_CHUNK members per call; what was queued for the old
        sessions is moot."""
        self.host.token = ""  # a new session, whatever the coordinator remembers
        tokens: list[str] = []
        for start in range(0, len(self.pop), JOIN_CHUNK):
            members = [pb.PopulationMember(agent_id=client_id(int(self.pop.numbers[i])),
                                           num_examples=max(1, int(self.train_sizes[i])),
                                           away=bool(self.offline[i]))
                       for i in range(start, min(start + JOIN_CHUNK, len(self.pop)))]
            reply = self.stub.JoinPopulation(pb.JoinPopulationRequest(
                host=self.host, members=members, protocol_version=PROTOCOL_VERSION), timeout=60)
            self.host.token = reply.host_token
            tokens.extend(reply.tokens)
            self.max_chunk = reply.max_chunk_bytes
        self.tokens = tokens
        self._held.clear()
        self._estimates = []
        self._drop_queued()
        with self._weights_lock:
            self._weights = (-1, None)

    def _drop_queued(self) -> None:
        """Forget the members' tasks no seat has started (training is over, or their sessions are gone)."""
        while True:
            try:
                item = self._tasks.get_nowait()
            except queue.Empty:
                return
            if item is None:  # a seat's stop: keep it
                self._tasks.put(None)
                return
            with self._in_flight_lock:
                self._in_flight -= 1

    def run(self) -> list[AgentStats]:
        """Join, then pull and run the members' tasks until the coordinator says training is over."""
        self.join()
        # the seats' small updates, batched (a few ms' wait for the seats still training saves calls)
        self.uploads = HostUploads(self.stub, self.host, self.max_chunk, linger=UPLOAD_LINGER,
                                   more_coming=lambda: self._in_flight > 0)
        workers = [threading.Thread(target=self._seat, args=(seat,), daemon=True) for seat in self.seats]
        for w in workers:
            w.start()
        try:
            while True:
                away, back = self._availability_changes()
                reply = self.calls.call(lambda: self.stub.PullHostTasks(pb.PullHostTasksRequest(
                    host=self.host, wait_seconds=self.poll_seconds, away=away, back=back,
                    finish_estimates=self._estimates), timeout=self.poll_seconds + 30))
                self._estimates = []
                if reply.shutdown_reason:
                    log.info("%s: coordinator says: %s", self.host.agent_id, reply.shutdown_reason)
                    break
                if reply.tasks and self._held:  # tasks held from an older round are moot once a newer one opens
                    newest = max(hosted.task.round for hosted in reply.tasks)
                    self._held = {m: held for m, held in self._held.items() if held[1].round >= newest}
                for hosted in reply.tasks:
                    i = self._index_of(hosted.agent_id)
                    if reply.weights:  # the round's small model, sent once for all of them
                        hosted.task.weights_header.CopyFrom(reply.weights_header)
                        hosted.task.weights = reply.weights
                    if hosted.task.virtual_clock:
                        self._estimates.append(self._hold(i, hosted.agent_id, hosted.task))
                    elif not (self.offline[i] or self._drops(i, hosted.task.round)):  # an offline or vanished
                        self.secure.arrived(self._auth(i), hosted.task, self.seats[0].layout, self.max_chunk)
                        self._start((i, hosted.task))  # device does not answer
                for member in reply.go:
                    if member in self._held:
                        self._start(self._held.pop(member))
        finally:
            self._drop_queued()  # training is over: tasks not started yet are moot
            for _ in workers:
                self._tasks.put(None)
            for w in workers:
                w.join(timeout=60)
            self.uploads.close()
            if self.uploads.refused_in_background:
                log.warning("%s: %d updates sent in the background were refused (--log-level info says why)",
                            self.host.agent_id, self.uploads.refused_in_background)
            for seat in self.seats:
                seat.close()
            if self.residuals is not None:
                self.residuals.close()
            self.channel.close()
        return [seat.stats for seat in self.seats]

    def _index_of(self, member: str) -> int:
        """The index of member ``member`` in the slice, found from the number its id carries (client_id) among the
        slice's ascending numbers: no table of ids held per member."""
        number = int(member.rpartition("-")[2])
        i = int(np.searchsorted(self.pop.numbers, number))
        if i >= len(self.pop) or self.pop.numbers[i] != number:
            raise KeyError(f"{member!r} is not a member of {self.host.agent_id}")
        return i

    def _hold(self, i: int, member: str, task: pb.TrainTask) -> pb.FinishEstimate:
        """Keep member ``i``'s task until the virtual clock lets it go; its simulated finish time, from its trace
        and its real amount of work (the local steps of its data at the task's epochs and batch size that fit)."""
        self.clock_seconds = task.clock_seconds
        self._held[member] = (i, task)
        examples = int(self.train_sizes[i])
        steps = task.local_epochs * math.ceil(examples / max(1, task.batch_size))
        task.max_steps, seconds = self.pop.work(i, steps, task.model_bytes, task.clock_seconds,
                                                task.clock_deadline_seconds, self._drops(i, task.round))
        return pb.FinishEstimate(agent_id=member, task_id=task.task_id, seconds=seconds)

    def _drops(self, i: int, round_id: int) -> bool:
        """Whether member ``i`` vanishes in round ``round_id``: its own draw, the same whichever host speaks for it."""
        if not self.pop.drop_probability:
            return False
        return np.random.default_rng([self.seed, int(self.pop.numbers[i]), round_id]).random() \
            < self.pop.drop_probability

    def _availability_changes(self) -> tuple[list[str], list[str]]:
        """Members that went offline and that came back since the last call, by the trace's clock: the
        coordinator's simulated time under a virtual clock, else one real second is ``day_scale`` trace seconds,
        from when this host started."""
        day = self.clock_seconds if self.clock_seconds is not None \
            else (time.monotonic() - self.started) * self.day_scale
        if self.events is None:
            return [], []
        maybe = self.events.between(self._offline_at, day)  # the others' windows neither opened nor closed
        self._offline_at = day
        now = ~online(day, self.pop.available_from[maybe], self.pop.available_for[maybe])
        changed = maybe[now != self.offline[maybe]]
        self.offline[changed] = ~self.offline[changed]
        ids = [(client_id(int(self.pop.numbers[i])), bool(self.offline[i])) for i in changed]
        return [m for m, gone in ids if gone], [m for m, gone in ids if not gone]

    def _start(self, item: tuple[int, pb.TrainTask]) -> None:
        """Queue member ``item[0]``'s task for the next free seat (it is in flight until that seat is done)."""
        with self._in_flight_lock:
            self._in_flight += 1
        self._tasks.put(item)

    def _seat(self, seat: Agent) -> None:
        """Run queued tasks on ``seat``, each as its member: the member's data and session, for that task only."""
        seat.trainer.warm_up()
        while (item := self._tasks.get()) is not None:
            i, task = item
            member = client_id(int(self.pop.numbers[i]))
            seed = client_seed(self.seed, member)
            auth = self._auth(i)
            try:
                # under the virtual clock a slow device costs simulated time, not real pauses
                seat.trainer.use_data(self.member_data(i), seed,
                                      0.0 if task.virtual_clock else float(self.pop.step_delays[i]))
                residuals = self._residual_store(seat)
                settings = TaskSettings.from_json(task.extra_json)
                seat.compression.give_residual(settings, residuals.load(member))
                # top-k's error feedback must know whether the update counted; other updates travel while the
                # seat trains its next client
                seat.send_small = self.uploads.send if settings.compression == "topk" else self.uploads.send_later
                seat.small_below = self.max_chunk + 1  # whole updates up to a chunk ride in the host's batches
                seat.run_task_as(auth, task, self.max_chunk, self._round_weights(seat, auth, task),
                                 self.secure.take(task))
                residuals.save(member, seat.compression.take_residual())  # the member's own error feedback
            except Exception:  # one member's failure must not stop the seat
                log.exception("%s: task of %s failed", self.host.agent_id, member)
            finally:  # its update, if any, is queued by now
                with self._in_flight_lock:
                    self._in_flight -= 1

    def _auth(self, i: int) -> pb.AgentAuth:
        """Member ``i``'s session."""
        return pb.AgentAuth(agent_id=client_id(int(self.pop.numbers[i])), token=self.tokens[i])

    def _residual_store(self, seat: Agent) -> ResidualStore:
        """The host's store of its members' residuals (made once, for the model's shapes)."""
        with self._residuals_lock:
            if self.residuals is None:
                self.residuals = ResidualStore([tuple(t.shape) for t in seat.layout.tensors])
            return self.residuals

    def _round_weights(self, seat: Agent, auth: pb.AgentAuth, task: pb.TrainTask) -> list[np.ndarray] | None:
        """The global model of ``task``'s round, read once per round for all this host's members: decoded from the
        first task that carries it (small models), else downloaded by the first member to need it, with its own
        session; None when that fails (the member then reads or fetches it itself, and reports what went wrong)."""
        with self._weights_lock:
            if self._weights[0] != task.round:
                try:
                    arrays = task_weights(task, seat.layout)
                    if arrays is None:
                        arrays = download_weights(seat.ingest_stub(task), auth, task, seat.layout, self.max_chunk,
                                                  timeout=max(1.0, task.deadline_seconds))
                except (grpc.RpcError, CodecError):
                    return None
                self._weights = (task.round, arrays)
            return self._weights[1]

