"""The client runtime: one process, one connection to the coordinator, hosting 1..N members.

A deployed agent (`fedpar client`, client/agent.py) is the runtime hosting one member, itself, under its own
certificate; a simulation worker (`fedpar simulate`, `fedpar simulate-workers`) is the same runtime hosting a slice
of a population (simulations/population.py), whose sampled members take turns on a few *seats* (trainers that
take on a member's data for one task). How it joins and pulls is its link's (client/links.py); the rest is written
once here: the round's download (once per round, for every member that needs it), the deadline rule
(fedpar/task.py), local training, the update transforms (client DP and compression: client/transfer.py's round
modes; SecAgg masking: client/secure_upload.py's) and the upload (over the data plane here; over gRPC, with its
retries: client/transfer.py UpdateSender, made here for each task).
"""

from __future__ import annotations

import functools
import logging
import queue
import random
import threading
import time
import zlib
from dataclasses import dataclass

import grpc
import numpy as np

from fedpar.client import dataplane
from fedpar.client.compressed import PreparedUpload, UpdateCompressor
from fedpar.client.backoff import Backoff, Pacer, jittered
from fedpar.client.links import (RETRYABLE, AgentConfig, AgentLink, Connection, FatalAgentError, HostLink, Members,
                                Reconnecting, check_task_clock)
from fedpar.client.member_state import ResidualNotKept, ResidualStore
from fedpar.client.model_fit import ModelMismatch
from fedpar.client.secure_members import SecureMembers
from fedpar.client.stats import AgentStats
from fedpar.client.trainer_protocol import CalledOff, UpdateRefused
from fedpar.client.transfer import (UPLOAD_RETRYABLE, CompressedUpload, PlainUpload, Send, UpdateSender,
                                    download_weights, ingest_address, task_weights)
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CodecError, ModelLayout, one_line
from fedpar.protocol.dataplane import TICKET_BYTES
from fedpar.protocol.task_settings import TaskSettings, check_task_knobs
from fedpar.task import TaskError, raised, stop_training_at, upload_ends_at

log = logging.getLogger("fedpar.client")
DATA_PLANE_BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
EVALUATED_TOGETHER = 128  # members whose validation splits one pass scores at most (bounds the data held at once)
MAX_REASON_CHARS = 500  # of the line a member's failed task is told to the coordinator with
# A pull answered sooner than this with nothing done (no task, or only tasks refused) was not a long-poll: the next one
# waits, backing off from this many seconds (a coordinator that answers at once must not make the agent spin).
IDLE_PULL_SECONDS = 0.05


@dataclass
class Seat:
    """A trainer the runtime's members take turns on, and the update compressor that goes with it (a member's
    top-k residual is given to it for the member's task when members outnumber seats)."""

    trainer: object
    compression: UpdateCompressor


class OwnMember:
    """The one member of a deployed agent: its id is the agent's, its data is in ``trainer``; it vanishes from a
    round with ``drop_probability`` (simulations of unreliable devices), drawn from ``seed``."""

    population = False
    answers_messages = False

    def __init__(self, agent_id: str, trainer, drop_probability: float = 0.0, seed: int | None = None):
        self.agent_id, self.trainer, self.drop_probability = agent_id, trainer, drop_probability
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return 1

    def member_id(self, i: int) -> str:
        """The agent's id."""
        return self.agent_id

    def seat_trainers(self, seats: int) -> list:
        """Its own trainer (one seat)."""
        return [self.trainer]

    def assign(self, trainer, i: int, task: pb.TrainTask) -> None:
        """Nothing: the trainer holds the agent's data already."""

    def vanishes(self, i: int, round_id: int) -> bool:
        """A drop-out draw (never, unless ``drop_probability``)."""
        return bool(self.drop_probability) and self._rng.random() < self.drop_probability


class ClientRuntime:
    """Hosts ``members`` (client/links.Members) behind one connection to ``config.server``, as ``config.agent_id``,
    on ``seats`` seats, until the coordinator says training is over (or :meth:`stop`).

    Its seats' trainers are :class:`~fedpar.client.trainer_protocol.Trainer`s; one with ``reads_task_settings``
    gets the task's settings in ``train``.
    """

    def __init__(self, config: AgentConfig, members: Members, seats: int = 1):
        self.config, self.members = config, members
        self.stats = AgentStats()
        self.shutdown_reason: str | None = None  # why the coordinator ended training, once it said so
        self._rng = random.Random(config.seed)
        self._stop = threading.Event()
        self.conn = Connection(config)
        trainers = members.seat_trainers(seats)
        # members that only answer a Flower App's Messages (client/flower_app_member.py) have no model layout
        self.layout = ModelLayout(trainers[0].array_specs()) if trainers and not members.answers_messages else None
        self.seats = [Seat(t, UpdateCompressor(self.layout, seed=zlib.crc32(
            f"{config.seed}:{config.agent_id}{f':{s}' if s else ''}".encode()))) for s, t in enumerate(trainers)]
        self._tasks: queue.Queue = queue.Queue()  # members' tasks for the seats (a population's)
        self._stats_lock = threading.Lock()
        self._weights: tuple[tuple[int, str], list[np.ndarray] | None] = ((-1, ""), None)  # (_weights_key, model)
        self._weights_lock = threading.Lock()
        # a population's members of a round score its global model on their validation splits together
        self._together = members.population and bool(trainers) and trainers[0].evaluates_together
        self._to_evaluate: dict[int, list[int]] = {}  # per round: members queued, not yet evaluated
        self._evaluations: dict[tuple[int, int], object] = {}  # (round, member): its EvalResult (or None)
        self._newest_round: int | None = None  # the round of the newest task received (another's uploads are moot)
        self._said_in_round: dict[str, int] = {}  # kind -> the last round a population's members were said of it
        self._evaluation_lock = threading.Lock()
        # members that outnumber the seats keep their top-k residuals on disk between their rounds
        self.residuals = ResidualStore([tuple(t.shape) for t in self.layout.tensors]) \
            if members.population and self.layout is not None else None
        self.secure = SecureMembers(self.conn.stub, config.poll_seconds)  # members' SecAgg+ client sides
        if members.population:
            self.link = HostLink(self.conn, config, members, self._forget_queued, self._trainable)
        else:
            self.link = AgentLink(self.conn, config, trainers[0])
        self._calls = Reconnecting(config.agent_id, config.server, self._join, config.initial_backoff,
                                   config.max_backoff, self._rng, config.give_up_after, self._stop.is_set,
                                   self.conn.why_unreachable, lambda: self._count("reconnects"))

    def say_outages_at(self, level: int) -> None:
        """Say an outage of the coordinator, its reminders and its end at ``level`` (INFO unless told)."""
        self._calls.level = level

    def stop(self) -> None:
        """Ask the runtime to leave after its current step."""
        self._stop.set()

    def close(self) -> None:
        """Stop the link's threads, close the connection and remove the members' residuals kept on disk."""
        self.link.close()
        self.conn.close()
        if self.residuals is not None:
            self.residuals.close()

    # ------------------------------------------------------------------ main loop
    def run(self) -> AgentStats:
        """Join, then pull and run the members' tasks until the coordinator says shutdown (or :meth:`stop`)."""
        inline = not self.members.population  # the member is the runtime: it trains between its pulls
        workers = [] if inline else [threading.Thread(target=self._seat, args=(seat,), daemon=True,
                                                      name=f"fedpar-seat{s}") for s, seat in enumerate(self.seats)]
        try:
            if self.seats:  # torch's lazy set-up (client batching's torch.func too) before joining, not in round 1
                self._warm_up(self.seats[0])
            self._calls.join()
            for w in workers:
                w.start()
            pace = Pacer(IDLE_PULL_SECONDS, self.config.max_backoff, self._rng,
                         fast=min(IDLE_PULL_SECONDS, self.config.poll_seconds / 2))
            while not self._stop.is_set():
                started, accepted = time.monotonic(), self.stats.accepted
                pulled = self._calls.call(self.link.pull)
                if pulled.shutdown is not None:
                    self.shutdown_reason = pulled.shutdown
                    log.info("%s: coordinator says: %s", self.config.agent_id, pulled.shutdown)
                    break
                queued = [(i, task) for i, task in pulled.tasks if self._dispatch(i, task, inline)]
                self._queue(queued)
                idle = not pulled.news and (self.stats.accepted == accepted if inline else not queued)
                self._stop.wait(pace.after(started, idle))
            return self.stats
        except FatalAgentError:
            if not self._stop.is_set():
                raise
            return self.stats  # stop() asked to leave while the coordinator was unreachable: no failure
        except KeyboardInterrupt:  # a signal: the coordinator hears of it now, and no seat's last task is waited for
            self._stop.set()
            self.link.leaving()
            workers = []
            raise
        finally:
            self._call_off_training()
            self._end_seats(workers)
            self.close()

    def _call_off_training(self) -> None:
        """Tell the seats' trainers that training is over: a slow device's pause (up to a day) ends at once."""
        for seat in self.seats:
            seat.trainer.call_off()

    def _end_seats(self, workers: list[threading.Thread]) -> None:
        """Call the seats off (training is over: tasks not started yet are moot) and wait for the tasks they are on;
        none given (a signal's stop), they are not waited for: a slow member's task would hold the stop up to a
        minute, and its update has no session left to go to."""
        self._forget_queued()
        for _ in self.seats:
            self._tasks.put(None)
        for w in workers:
            if w.ident is not None:  # started: a refused join ends the run before the seats start
                w.join(timeout=60)

    def _join(self) -> None:
        """A new session (for every member); the round's weights read under the old one are read again."""
        self.link.join()
        with self._weights_lock:
            self._weights = ((-1, ""), None)

    def _dispatch(self, i: int, task: pb.TrainTask, inline: bool) -> bool:
        """Run member ``i``'s task now (``inline``), or say it is to be queued for the next free seat (True); a
        member that vanishes this round (drops out, or is offline) takes no part."""
        self._count("tasks")
        if not self._trainable(i, task):
            return False
        self._newest_round = task.round
        if self.members.vanishes(i, task.round):
            self._count("dropped")
            self.link.finished(task)
            return False
        if self.layout is not None and _secure(task):  # a secure round's key exchange starts as the task arrives
            self.secure.arrived(self.link.member_auth(i), task, self.layout, self._chunk_bytes(),
                                self._refusals_of(self.members.member_id(i)))
        if inline:
            self.run_task(self.seats[0], i, task)
            return False
        self.link.tasks_in_flight(1)
        if self._together:
            with self._evaluation_lock:
                if task.round not in self._to_evaluate:
                    self._forget_evaluations_before(task.round)
                self._to_evaluate.setdefault(task.round, []).append(i)
        return True

    def _trainable(self, i: int, task: pb.TrainTask) -> bool:
        """Whether ``task``'s own knobs are ones to train with; one that is not is refused in one line and told to
        the coordinator (no update will come for it, whatever the wait)."""
        try:
            check_task_knobs(task.round, task.local_epochs, task.batch_size, task.learning_rate, task.deadline_seconds)
            check_task_clock(task)
            self.conn.check_ingest(task)
        except ValueError as err:
            self._note_refusal(self.members.member_id(i), f"round {task.round} task", err)
            self._told_failed(i, task, f"task refused: {err}"[:MAX_REASON_CHARS])
            return False
        return True

    def _queue(self, tasks: list[tuple[int, pb.TrainTask]]) -> None:
        """Queue a pull's ``tasks`` for the seats, told first how many of each round come (stacked seats start
        training when they all sit, not after a wait for more)."""
        for round_id in sorted({task.round for _, task in tasks}):
            self.seats[0].trainer.tasks_queued(round_id, sum(task.round == round_id for _, task in tasks))
        for item in tasks:
            self._tasks.put(item)

    def _seat(self, seat: Seat) -> None:
        """Run queued tasks on ``seat``, each as its member, for that task only."""
        self._warm_up(seat)
        while (item := self._tasks.get()) is not None:
            i, task = item
            try:
                self.run_task(seat, i, task)
            except Exception as err:  # one member's failure must not stop the seat
                # once stopped, what the task used (its connection, its residuals) may be closed under it: moot
                if self._stop.is_set():
                    log.debug("%s: task of %s failed", self.config.agent_id, self.members.member_id(i), exc_info=True)
                    continue
                log.error("%s: task of %s failed", self.config.agent_id, self.members.member_id(i), exc_info=True)
                # no update will come for it: its round need not wait out its deadline (a round it already
                # counted an update of is left as it is)
                self._told_failed(i, task, f"agent failed: {raised(err)}"[:MAX_REASON_CHARS])
            finally:  # its update, if any, is queued by now
                self.link.tasks_in_flight(-1)

    def _warm_up(self, seat: Seat) -> None:
        """``seat``'s trainer's warm-up; one that raises (the task's loss, say) is left for the training to report,
        member by member, as its task fails."""
        try:
            seat.trainer.warm_up()
        except Exception:
            if not seat.trainer.survives_failed_training:
                raise
            log.debug("%s: warm-up failed; the training will say why", self.config.agent_id, exc_info=True)

    def _forget_queued(self) -> None:
        """Forget the members' tasks no seat has started (training is over, or their sessions are gone)."""
        while True:
            try:
                item = self._tasks.get_nowait()
            except queue.Empty:
                return
            if item is None:  # a seat's stop: keep it
                self._tasks.put(None)
                return
            self.seats[0].trainer.tasks_queued(item[1].round, -1)
            self.link.tasks_in_flight(-1)

    # ------------------------------------------------------------------ one task
    def run_task(self, seat: Seat, i: int, task: pb.TrainTask) -> bool:
        """Member ``i``'s ``task`` on ``seat``: its data, its session, its residual; True when done with (False: the
        task should be pulled again, its weights never came)."""
        member = self.members.member_id(i)
        # held from the start: a member whose data fails to load leaves its round's stack at once
        with seat.trainer.holding_task(task.round):
            try:
                self.members.assign(seat.trainer, i, task)
            except Exception as err:  # the member's data (the task's client_data, say)
                finished = self._failed(seat, i, task, "data", err)
            else:
                if task.flower_message:  # a Flower App run's round: the member answers the Message its task carries
                    finished = self._reply(i, member, self.link.member_auth(i), task)
                elif self.layout is None:  # members that only answer Messages get a round of fedpar's own
                    self._note_refusal(member, "task", ValueError(
                        "this coordinator runs fedpar's strategies, which need the app's initial arrays: name them "
                        "in its pyproject.toml ([tool.fedpar] model = 'module:factory'), or serve the app with "
                        "--flower-app"))
                    finished = True
                else:
                    finished = self._train_and_upload(seat, i, member, self.link.member_auth(i), task)
        if finished:
            self.link.finished(task)
        return finished

    def _train_and_upload(self, seat: Seat, i: int, member: str, auth: pb.AgentAuth, task: pb.TrainTask) -> bool:
        received = time.monotonic()
        deadline_at = received + task.deadline_seconds
        try:
            settings = TaskSettings.from_json(task.extra_json)
        except ValueError as err:  # told, as a task's bad knobs are: no update will come for it, whatever the wait
            self._note_refusal(member, "task settings", err)
            self._told_failed(i, task, f"task refused: {err}"[:MAX_REASON_CHARS])
            return True
        data_plane = self.data_plane(task)
        mode = (self.secure.take(task) if settings.secure_aggregation else None) or \
            self._round_mode(seat, auth, task, settings, deadline_at, data_plane)
        if not mode.begin():
            return True
        # The upload is budgeted from what came after begin(): a secure round's key exchange waits there for the
        # cohort (up to --secagg-stage-seconds when a member drops), which says nothing of how long an upload takes.
        fetching = time.monotonic()
        weights = self._round_weights(i, member, auth, task, data_plane)
        if weights is None:
            return False
        if weights is True:
            return True
        if self.residuals is not None and settings.compression != "none":  # its error feedback, from earlier rounds
            seat.compression.give_residual(settings, self.residuals.load(member))
        seat.trainer.set_arrays(weights)
        metrics: dict[str, float] = {}
        try:
            evaluation = self._evaluation(seat, i, task.round, settings) if settings.evaluate else None
        except Exception as err:  # the task's evaluation, say
            return self._failed(seat, i, task, "evaluation", err)
        if evaluation is not None:
            metrics.update(evaluation.as_metrics())  # what was measured, and finite (a Flower client's may lack some)
        stop_at = stop_training_at(deadline_at, time.monotonic() - fetching, self.config.upload_margin_seconds)
        with self.link.while_training():
            extra = {"max_steps": task.max_steps} if task.max_steps else {}  # the virtual clock's cap (a TaskTrainer's)
            if seat.trainer.reads_task_settings:  # e.g. a Flower client's fit config
                extra["settings"] = settings
            try:
                result = seat.trainer.train(task.local_epochs, task.batch_size, task.learning_rate, stop_at=stop_at,
                                            proximal_mu=settings.proximal_mu or 0.0, round_id=task.round, **extra)
            except CalledOff:  # the runtime is stopping: the round's update is moot
                return True
            except UpdateRefused as err:  # e.g. a Flower ClientApp's reply that cannot be an update
                self._note_refusal(member, f"round {task.round} train", err, logging.WARNING)  # the user's code
                self._told_failed(i, task, f"training made no update: {err}")
                return True
            except Exception as err:  # the task's code, say (its training step raised)
                return self._failed(seat, i, task, "training", err)
        if result.examples == 0:
            self._no_time_to_train(member, task.round)
            return True
        metrics.update(result.as_metrics())  # a NaN loss (e.g. a Flower client's fit that reports none) is left out
        # heartbeats go on while the update goes up: a long upload (to another aggregator rank, say) must not let the
        # agent's liveness run out, which would count it as gone (server/deadline.py)
        with self.link.while_training():
            try:
                uploaded = mode.upload(seat.trainer.get_arrays(), weights, result, metrics, upload_ends_at(deadline_at))
            except UpdateRefused as err:  # training diverged: told at once, so the round need not wait for it
                self._note_refusal(member, f"round {task.round} update", f"{err}: not sent",
                                   logging.INFO if self.members.population else logging.WARNING)
                self._told_failed(i, task, str(err)[:MAX_REASON_CHARS])
                return True
        if uploaded:
            self._count("accepted")
            mode.close()
        if self.residuals is not None:
            try:
                self.residuals.save(member, seat.compression.take_residual())
            except ResidualNotKept as err:  # its update went up: only its error feedback starts again from zero
                self._residual_not_kept(member, task.round, err)
        return True

    def _over(self, round_id: int, since: float) -> bool:
        """Whether round ``round_id`` is over for this runtime: a task of another round came, or (an agent) a
        heartbeat reply since ``since`` names another round (a run of a service ended while this agent retried an
        upload to an aggregator rank that went with it: its next task waits behind the upload)."""
        heard = self.link.round_heard_since(since)
        return self._newest_round != round_id or (heard is not None and heard != round_id)

    def _no_time_to_train(self, member: str, round_id: int) -> None:
        """``member`` skips its upload of ``round_id``: no time was left to train."""
        self._say_per_round("no time", round_id, f"{member}: no time left to train in round {round_id}; skipping the "
                            "upload", f"members had no time left to train in round {round_id}, so they skip their "
                            "uploads (the deadline is short for them; --log-level info names each)")

    def _residual_not_kept(self, member: str, round_id: int, err: ResidualNotKept) -> None:
        """``member``'s compression residual of ``round_id`` could not be written: it starts again from zero."""
        self._say_per_round("residual", round_id, f"{member}: {err}; its error feedback starts again from zero",
                            f"members' compression residuals of round {round_id} cannot be kept ({err}); their "
                            "error feedback starts again from zero, their updates still count (free space there, or "
                            "give TMPDIR a folder with room; --log-level info names each)")

    def _say_per_round(self, kind: str, round_id: int, each: str, once: str) -> None:
        """A line that an agent says each time (``each``), and a population's host once a round of each ``kind``
        (``once``: thousands of its members may meet the same cause), naming each member at info level."""
        if not self.members.population:
            log.warning("%s", each)
            return
        log.info("%s", each)
        with self._stats_lock:
            said, self._said_in_round[kind] = self._said_in_round.get(kind), round_id
        if said != round_id:
            log.warning("%s: %s", self.config.agent_id, once)

    def _failed(self, seat: Seat, i: int, task: pb.TrainTask, stage: str, err: Exception) -> bool:
        """Member ``i``'s own code raised ``err`` in its ``stage`` of ``task`` (data, evaluation, training): noted
        in one line (its traceback in the debug log) and told to the coordinator at once, so that the round does not
        wait out its deadline for the update that will not come; True (done with the task). On a trainer that a
        failure leaves unfit for the next task (an engine's ranks stop together) ``err`` is raised on."""
        if not seat.trainer.survives_failed_training:
            raise err
        member = self.members.member_id(i)
        # fedpar's own diagnosis of the task is said as it is; anything else is what the task's code raised
        reason = (f"{stage} failed: {err}" if isinstance(err, TaskError) else f"{stage} raised {raised(err)}")[
            :MAX_REASON_CHARS]
        log.debug("%s: round %d %s", member, task.round, reason, exc_info=err)
        # a deployed agent's log is its operator's only view; a population's members are said by the coordinator
        self._note_refusal(member, f"round {task.round} task", reason,
                           logging.INFO if self.members.population else logging.WARNING)
        self._told_failed(i, task, reason)
        return True

    def _reply(self, i: int, member: str, auth: pb.AgentAuth, task: pb.TrainTask) -> bool:
        """Member ``i``'s reply to its task's Flower Message, sent with ReplyMessage and retried while the coordinator
        is busy and the deadline allows (a reply that misses the deadline is no reply, as in Flower)."""
        deadline_at = time.monotonic() + task.deadline_seconds
        try:
            settings = TaskSettings.from_json(task.extra_json)  # the run's config, for the ClientApp's Context
            with self.link.while_training():  # heartbeats while the ClientApp works
                reply = self.members.answer(i, task.flower_message, self.link.max_chunk or self.config.chunk_bytes,
                                            settings.run_config)
        except ValueError as err:  # the task's settings or Message cannot be read: nothing to answer
            self._note_refusal(member, "message", err)
            return True
        if reply.error is not None:  # Flower's error reply still goes up (the ServerApp counts it), as no update
            self._count("failed")
            self._note_refusal(member, f"round {task.round} message", reply.error, logging.DEBUG)  # warned already
        request = pb.MessageReply(auth=auth, round=task.round, task_id=task.task_id, message=reply.data)
        backoff = Backoff(0.1, 2.0, self._rng)
        ends_at = upload_ends_at(deadline_at)
        while True:
            try:
                self.conn.stub.ReplyMessage(request, timeout=ends_at - time.monotonic())
                if reply.error is None:
                    with self._stats_lock:
                        self.stats.answered[reply.message_type] = self.stats.answered.get(reply.message_type, 0) + 1
                return True
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return True
                if err.code() not in UPLOAD_RETRYABLE or not backoff.fits_before(deadline_at):
                    if reply.error is None:  # a failed task is counted once
                        self._note_refusal(member, "reply", err)
                    return True
                self._stop.wait(backoff.wait())

    def _round_weights(self, i: int, member: str, auth: pb.AgentAuth, task: pb.TrainTask,
                       data_plane: dataplane.DataPlaneTarget | None) -> list[np.ndarray] | bool | None:
        """The global model of ``task``'s round, read once per round for all the runtime's members: decoded from the
        task (small models come inside it), else over the data plane or the gRPC stream by the first member to need
        it, with member ``i``'s session. None: not read, pull the task again (the coordinator hands it out until a
        download completes); True: refused, done with the task (noted; a model unlike this agent's is told to the
        coordinator as the member's failure, and stops a deployed agent: FatalAgentError)."""
        key = self._weights_key(task)
        held = self._weights  # one tuple, replaced whole: read without the lock once the round's model is here
        if held[0] == key:
            return held[1]
        with self._weights_lock:
            if self._weights[0] == key:
                return self._weights[1]
            try:
                weights = task_weights(task, self.layout)
                if weights is None and data_plane is not None:
                    weights = self._via_data_plane("download", dataplane.download, data_plane, self.layout,
                                                   max(1.0, task.deadline_seconds))
                if weights is None:
                    weights = download_weights(self.conn.ingest_stub(task), auth, task, self.layout,
                                               self.link.max_chunk, timeout=max(1.0, task.deadline_seconds))
            except (grpc.RpcError, CodecError, dataplane.DataPlaneRefused) as err:
                self._note_refusal(member, "download", err)
                if isinstance(err, CodecError):  # no update will come, whatever the wait
                    reason = err.reason() if isinstance(err, ModelMismatch) else f"download refused: {err}"
                    self._told_failed(i, task, reason[:MAX_REASON_CHARS])
                if isinstance(err, ModelMismatch) and not self.members.population:  # no round ever will: stop
                    raise FatalAgentError(err.refusal(self.config.agent_id)) from None
                if isinstance(err, grpc.RpcError) and err.code() in RETRYABLE:
                    self._stop.wait(jittered(self.config.initial_backoff, self._rng))  # then pull again
                    return None
                return True
            self._weights = (key, weights)
            return weights

    @staticmethod
    def _weights_key(task: pb.TrainTask) -> tuple[int, str]:
        """Which tasks share the global model read for ``task``: those naming its model (a population's members of
        one round of one run); from a coordinator that names none, the task alone."""
        return task.round, task.model_id or task.task_id

    def _evaluation(self, seat: Seat, i: int, round_id: int, settings: TaskSettings):
        """Member ``i``'s metrics of round ``round_id``'s global model (loaded in ``seat``'s trainer) on its
        validation split. A population's seat scores every member of the round queued so far in one pass and keeps
        the others' results for their turn (they all score the same model); a trainer that reads task settings
        gets them (e.g. a Flower evaluate config)."""
        trainer = seat.trainer
        if not self._together:
            return trainer.evaluate(**({"settings": settings} if trainer.reads_task_settings else {}))
        with self._evaluation_lock:
            if (round_id, i) not in self._evaluations:
                self._forget_evaluations_before(round_id)
                queued = [j for j in dict.fromkeys(self._to_evaluate.pop(round_id, []))
                          if j != i and (round_id, j) not in self._evaluations]
                group, rest = [i, *queued[:EVALUATED_TOGETHER - 1]], queued[EVALUATED_TOGETHER - 1:]
                if rest:
                    self._to_evaluate[round_id] = rest
                splits = []
                for j in list(group):
                    try:
                        splits.append(self.members.validation(j))
                    except Exception:
                        if j == i:
                            raise
                        group.remove(j)  # a neighbour's data that does not load fails its own task, on its own turn
                results = trainer.evaluate_splits(splits)
                self._evaluations.update(((round_id, j), result) for j, result in zip(group, results))
            return self._evaluations.pop((round_id, i))

    def _forget_evaluations_before(self, round_id: int) -> None:
        """Drop the queued members and kept results of rounds before ``round_id`` (under the evaluation lock): their
        tasks were dropped unrun, or their round scored nothing (--client-eval-every), so no turn will take them; a
        member of such a round still training scores its own split alone."""
        if any(r < round_id for r, _ in self._evaluations):
            self._evaluations = {key: e for key, e in self._evaluations.items() if key[0] >= round_id}
        if any(r < round_id for r in self._to_evaluate):
            self._to_evaluate = {r: queued for r, queued in self._to_evaluate.items() if r >= round_id}

    def _round_mode(self, seat: Seat, auth: pb.AgentAuth, task: pb.TrainTask, settings: TaskSettings,
                    deadline_at: float, data_plane: dataplane.DataPlaneTarget | None) -> PlainUpload:
        """How this task's update is made and sent, as its settings say (client/transfer.py's round modes and
        its sender, behind the data plane when the task offers it); a secure round's mode was made as its
        task arrived (client/secure_members.py)."""
        note = self._refusals_of(auth.agent_id)
        started = time.monotonic()  # heartbeat replies heard after this speak of this task's round or a later one
        # Top-k's error feedback must know whether the update counted; other small updates of a population may
        # travel while its seat trains the next member.
        stub = self.conn.ingest_stub(task)
        rank = ingest_address(self.config.server, task)  # a rank that refuses connections: the upload is given up
        sender = UpdateSender(auth, task, stub, self.link.small_sender(settings.compression == "topk", stub),
                              deadline_at, self._chunk_bytes(), self.link.max_chunk, self.link.small_below, self._rng,
                              note, superseded=lambda: self._over(task.round, started), stopped=self._stop.is_set,
                              rank=rank if rank != self.config.server else None, server=self.config.server,
                              give_up_after=self.config.give_up_after)
        send = sender.send if data_plane is None else \
            functools.partial(self._upload_via_data_plane, auth, task, data_plane, deadline_at, sender.send)
        if settings.compression != "none":
            return CompressedUpload(settings, self.layout, send, seat.compression)
        return PlainUpload(settings, self.layout, send)

    def _upload_via_data_plane(self, auth: pb.AgentAuth, task: pb.TrainTask, data_plane: dataplane.DataPlaneTarget,
                               deadline_at: float, grpc_send: Send, upload: PreparedUpload, result,
                               metrics: dict[str, float], ends_at: float) -> bool:
        """Send the prepared update over the data plane (plain weights only; compressed updates are small), retried
        while the coordinator says it is busy and the deadline allows, over by ``ends_at``; True if accepted.
        ``grpc_send`` (the gRPC stream) takes it when the connection broke, or for an encoded update."""
        backoff: Backoff | None = None  # made at the first refusal to retry: most uploads go through at once
        while not upload.encoding:  # leaves for gRPC only if the connection broke
            try:
                if self._via_data_plane("upload", dataplane.upload, data_plane, auth, task, self.layout,
                                        upload.arrays, result.examples, result.steps, metrics,
                                        ends_at - time.monotonic()) is None:
                    break
                return True
            except dataplane.DataPlaneRefused as err:
                # RESOURCE_EXHAUSTED: busy (upload queue) or rate-limited; retry while the deadline allows.
                if self._stop.is_set():
                    return False
                backoff = backoff or Backoff(0.1, 2.0, self._rng)
                if err.code != DATA_PLANE_BUSY or not backoff.fits_before(deadline_at):
                    self._note_refusal(auth.agent_id, "upload", err)
                    return False
                self._stop.wait(backoff.wait())
        return grpc_send(upload, result, metrics, ends_at)

    def _chunk_bytes(self) -> int:
        return min(self.link.max_chunk or self.config.chunk_bytes, self.config.chunk_bytes)

    def data_plane(self, task: pb.TrainTask) -> dataplane.DataPlaneTarget | None:
        """Where to move this task's weights outside gRPC, or None (not offered, off, or no TLS for it)."""
        if not (self.config.data_plane and data_plane_offered(task)):
            return None
        if self.config.credentials is not None and self.config.data_tls is None:
            return None  # never send weights in plaintext beside a TLS control channel
        return dataplane.DataPlaneTarget(ingest_address(self.config.server, task), task, self.config.data_tls,
                                         self.config.tls_server_name)

    def _via_data_plane(self, what: str, fn, *args):
        """``fn(*args)``, or None after a transport failure (the caller then uses the gRPC stream)."""
        try:
            return fn(*args)
        except dataplane.DataPlaneError as err:
            log.info("%s: data-plane %s failed (%s); using the gRPC stream", self.config.agent_id, what, err)
            return None

    def _told_failed(self, i: int, task: pb.TrainTask, reason: str) -> None:
        """Member ``i``'s side failed ``task`` (its code raised, it refused the task, its download did not fit):
        counted, and told to the coordinator (``reason``: one line) so the round need not wait for it."""
        self._count("failed")
        self.link.failed(i, task, reason)

    def _count(self, what: str) -> None:
        with self._stats_lock:
            setattr(self.stats, what, getattr(self.stats, what) + 1)

    def _refusals_of(self, member: str):
        """How member ``member``'s refusals are noted (for the round modes)."""
        return functools.partial(self._note_refusal, member)

    def _note_refusal(self, member: str, what: str, err: Exception | str, level: int = logging.INFO) -> None:
        detail = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.RpcError) else str(err)
        if isinstance(err, dataplane.DataPlaneRefused):
            detail = dataplane.refusal_text(err)
        detail = one_line(detail)  # it may quote the coordinator: a line, printable
        with self._stats_lock:
            self.stats.refused += 1
            if len(self.stats.refusals) < 100:  # a population's may be many: the first ones say why
                self.stats.refusals.append(f"{what}: {detail}")
        log.log(level, "%s: %s refused: %s", member, what, detail)


def data_plane_offered(task: pb.TrainTask) -> bool:
    """Whether the coordinator offered the data plane for ``task`` (its port and a whole ticket)."""
    return bool(task.data_port) and len(task.data_ticket) == TICKET_BYTES


def _secure(task: pb.TrainTask) -> bool:
    """Whether ``task`` is of a secure round (its settings unreadable: no; running it says what is wrong)."""
    try:
        return TaskSettings.from_json(task.extra_json).secure_aggregation
    except ValueError:
        return False
