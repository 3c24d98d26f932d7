"""A Flower ``ClientApp`` (Message API) as the trainer of fedpar's members: ``--flower-app DIR`` when fedpar drives.

For each task of a member the client runtime (client/runtime.py) hands this trainer the round's global arrays; it
calls the ClientApp as Flower's SuperNode does, ``app(message, context)`` (so the app's client mods and lifespan
apply):
  * the Message's content is a RecordDict ``{"arrays": ArrayRecord, "config": ConfigRecord}`` and its type
    ``"evaluate"`` (on the global arrays, when the round evaluates) then ``"train"``; ``group_id`` is the round;
  * the ConfigRecord holds ``server-round`` (as Flower's strategies set it), fedpar's local training settings
    ``lr``, ``local-epochs``, ``batch-size``, ``deadline-seconds`` (seconds the handler may take before the update
    must go up), ``proximal-mu`` when FedProx asks for it, ``max-steps`` when capped, and the config a Flower
    strategy's ``configure_train`` made (``--strategy flower:...``);
  * the Context is the member's: ``node_id`` (protocol/flower_nodes.py), ``node_config`` ``partition-id`` /
    ``num-partitions``, the app's ``run_config``, and a ``state`` RecordDict that persists across the member's
    rounds (:class:`MemberStates`).
A reply that cannot be an update is refused with its reason (:class:`~fedpar.client.trainer_protocol.UpdateRefused`):
the handler raised, the reply carries an error, it has no single ArrayRecord, its arrays differ from the global
model in names, shapes or dtypes, its MetricRecord lacks a whole ``num-examples``. The runtime notes the refusal and
the run goes on without that member's update.

When the app's own ServerApp drives (server/flower_grid.py), a member answers the Message its task carries
(:func:`answer_message`): the ClientApp is called on it with the member's Context and the reply goes back serialized
with Flower's serde; a handler that raises, a reply that is not a reply to that Message, and one too large to travel
(over the coordinator's --max-chunk-bytes) become Flower's error reply with the reason, which goes up as Flower's
SuperNode sends it but counts in the runtime's stats as a failed task, not an accepted update (:class:`Answer`). A
simulation's members are simulations/client_app_population.py's; a deployed agent's one member is
:class:`FlowerAppAgent`.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from fedpar.client.local_loop import TrainResult
from fedpar.client.runtime import OwnMember
from fedpar.client.trainer_protocol import HeldArrays, UpdateRefused
from fedpar.protocol.codec import CodecError, ModelLayout
from fedpar.protocol.flower_nodes import SERVER_NODE_ID, node_id_of
from fedpar.protocol.flower_wire import FlowerWireError, decode_message, encode_message
from fedpar.protocol.task_settings import TaskSettings
from fedpar.tasks.evaluation import EvalResult

log = logging.getLogger("fedpar.client")
Spec = tuple[str, str, tuple[int, ...]]
MEMBER_STATES = 4096  # members whose Context.state a process keeps (least recently trained forgotten first)
MESSAGE_TTL = 43_200.0  # seconds: Flower's default time-to-live of a message
WEIGHT_KEY = "num-examples"  # the MetricRecord entry that weighs an update, as Flower's strategies read it
ERROR_CODE = 2  # flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION, as Flower's SuperNode replies


class MemberStates:
    """Each member's ``Context.state`` RecordDict, kept across its rounds for at most ``capacity`` members: in a
    simulation members are made on demand, so the least recently used member's state is forgotten first (it then
    starts again from an empty state, as a restarted Flower SuperNode does)."""

    def __init__(self, capacity: int = MEMBER_STATES):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._states: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    def of(self, member_id: str):
        """Member ``member_id``'s state (a new, empty RecordDict the first time or after it was forgotten)."""
        from flwr.app import RecordDict
        with self._lock:
            state = self._states.pop(member_id, None)
            if state is None:
                state = RecordDict()
                if len(self._states) >= self.capacity:
                    forgotten, _ = self._states.popitem(last=False)
                    log.debug("forgetting the Context.state of %s (more than %d members)", forgotten, self.capacity)
            self._states[member_id] = state
            return state


def member_context(member_id: str, partition_id: int, num_partitions: int, run_config: dict[str, Any], state,
                   run_id: int = 0):
    """The ``flwr.app.Context`` member ``member_id`` gets: its node id, partition, the run config and its state."""
    from flwr.app import Context
    node_config = {"partition-id": int(partition_id), "num-partitions": int(num_partitions)}
    return Context(run_id=run_id, node_id=node_id_of(member_id), node_config=node_config, state=state,
                   run_config=dict(run_config))


def runs_config(own: dict[str, Any], sent: dict[str, Any] | None) -> dict[str, Any]:
    """The run config a member's ClientApp sees: the one the coordinator sent with the task (the run's, as a Flower
    SuperNode's ClientApp gets it), else the app's own (``own``: its pyproject.toml's, with this process's
    --run-config); where the two differ, that is said once a process."""
    if sent is None:
        return own
    if sent != own:
        differ = tuple(sorted(k for k in set(own) | set(sent) if own.get(k) != sent.get(k)))
        if differ not in _SAID_DIFFERENT and len(_SAID_DIFFERENT) < MAX_SAID_DIFFERENT:
            _SAID_DIFFERENT.add(differ)
            log.info("the coordinator's run config (its app's with its --run-config) replaces this agent's (its "
                     "copy of the app's [tool.flwr.app.config] with its own --run-config, if any) in %s (%s)",
                     ", ".join(differ), "; ".join(f"{k}: {sent.get(k)!r}, here {own.get(k)!r}" for k in differ[:5]))
    return sent


MAX_SAID_DIFFERENT = 64  # differences said per process: an agent serving run after run says no more than this
_SAID_DIFFERENT: set[tuple[str, ...]] = set()  # the differences runs_config logged


class Answer(NamedTuple):
    """A member's reply to a Flower Message, serialized (``data``), why it is Flower's error reply (``error``;
    None: the ClientApp's own reply), and the type of the message it answers (``message_type``: train, evaluate,
    query)."""

    data: bytes
    error: str | None = None
    message_type: str = ""


def answer_message(client_app: Any, data: bytes, max_bytes: int, member_id: str,
                   context_of: Callable[[int], Any]) -> Answer:
    """Member ``member_id``'s reply to the Flower Message in ``data``: ``client_app`` called on it with
    ``context_of(run_id)`` (Flower's error reply when the app fails); FlowerWireError when ``data`` is no Message."""
    from flwr.app import Error, Message

    try:
        message = decode_message(data, max_bytes)
    except FlowerWireError as exc:  # the coordinator's bytes: nothing to reply to
        log.warning("%s: the task's Flower Message cannot be read: %s", member_id, exc)
        raise
    error, message_type = None, message.metadata.message_type
    try:
        reply = client_app(message, context_of(message.metadata.run_id))
        if not isinstance(reply, Message):
            raise TypeError(f"the ClientApp returned a {type(reply).__name__}, not a flwr.app.Message")
        if reply.metadata.reply_to_message_id != message.metadata.message_id:
            raise ValueError("the ClientApp's reply does not answer the message it was given (make it with "
                             "Message(content, reply_to=msg))")
    except Exception as exc:  # the app's own failure: Flower's SuperNode replies with an error, so do we
        reason = f"{type(exc).__name__}: {_one_line(exc)}"
        error = f"ClientApp {message.metadata.message_type} handler failed: {reason}"
        log.warning("%s: %s", member_id, error)
        reply = Message(Error(code=ERROR_CODE, reason=f"ClientApp of {member_id} failed: {reason}"), reply_to=message)
    else:
        if reply.has_error():  # the app's own error reply (a client mod's, say): it goes up as it is
            error = f"ClientApp {message.metadata.message_type} reply carries an error: {reply.error.reason}"
            log.warning("%s: %s", member_id, error)
    data = encode_message(reply)
    if len(data) > max_bytes:  # it cannot travel: the coordinator would hear nothing until the round's deadline
        reason = (f"its {message.metadata.message_type} reply of {len(data):,} bytes is over the {max_bytes:,}-byte "
                  "limit of one message (the coordinator's --max-chunk-bytes): send less, or raise it (at most 64 MiB)")
        error = f"ClientApp {reason}"
        log.warning("%s: %s", member_id, error)
        data = encode_message(Message(Error(code=ERROR_CODE, reason=f"ClientApp of {member_id}: {reason}"),
                                      reply_to=message))
    return Answer(data, error, message_type)


LOSS_KEYS = ("eval_loss", "loss")  # an evaluate reply's loss, first found
ACCURACY_KEYS = ("eval_acc", "accuracy", "eval_accuracy")  # and accuracy


class FlowerAppTrainer(HeldArrays):
    """The runtime's trainer protocol (client/trainer_protocol.py) over a Flower ``ClientApp``; ``initial`` holds the
    global model's (name, array) pairs (their names, shapes and dtypes are what replies must match; None: the app
    names no model, so its seat only answers a ServerApp's Messages). A seat takes on one member
    after another (:meth:`use_member`)."""

    framework = "flower-app"
    reads_task_settings = True  # the ConfigRecord carries a Flower strategy's configure_train config

    def __init__(self, client_app: Any, run_config: dict[str, Any],
                 initial: Sequence[tuple[str, np.ndarray]] | None, states: MemberStates | None = None,
                 run_id: int = 0):
        self.app = client_app
        self.run_config = dict(run_config)
        self.names = [name for name, _ in initial or ()]
        self.layout = ModelLayout.of_arrays(self.names, [a for _, a in initial]) if initial is not None else None
        self.states = states if states is not None else MemberStates()
        self.run_id = run_id
        self._member: tuple[str, int, int, int] = ("member", 0, 1, 1)  # (id, partition, partitions, examples)

    def use_member(self, member_id: str, partition_id: int, num_partitions: int, num_examples: int) -> None:
        """Train from now on as member ``member_id``: partition ``partition_id`` of ``num_partitions``, declaring
        ``num_examples`` training examples at Join."""
        self._member = (member_id, int(partition_id), int(num_partitions), int(num_examples))

    def context(self, run_id: int | None = None, run_config: dict[str, Any] | None = None):
        """The current member's Context (its state is the one kept for it) in run ``run_id`` (None: this trainer's),
        with the run's config the task carried (None: the app's own, :func:`runs_config`)."""
        member, partition, partitions, _ = self._member
        return member_context(member, partition, partitions, runs_config(self.run_config, run_config),
                              self.states.of(member), self.run_id if run_id is None else run_id)

    # ------------------------------------------------------------------ the runtime's trainer protocol
    @property
    def num_examples(self) -> int:
        """The member's declared training-set size."""
        return self._member[3]

    def array_specs(self) -> list[Spec]:
        """(name, dtype, shape) of the global model's arrays."""
        if self.layout is None:
            raise RuntimeError("a ClientApp trainer without initial arrays has no array specs")
        return self.layout.specs()

    def evaluate(self, settings: TaskSettings | None = None) -> EvalResult | None:
        """The app's evaluate handler on the global arrays (its config: ``server-round`` and a Flower strategy's
        ``configure_evaluate`` config): loss and accuracy from its MetricRecord (``eval_loss`` or ``loss``,
        ``eval_acc`` or ``accuracy``) and its other finite metrics by name; None when it has no loss or fails
        (logged: training goes on)."""
        config = {"server-round": self._round, **((settings.eval_config or {}) if settings is not None else {})}
        try:
            reply = self._call("evaluate", config, settings.run_config if settings is not None else None)
            metrics = _metrics_of(reply, "evaluate")
        except UpdateRefused as err:
            log.warning("%s: evaluate: %s", self._member[0], err)
            return None
        examples = metrics.get(WEIGHT_KEY)
        loss_key = next((k for k in LOSS_KEYS if _finite(metrics.get(k))), None)
        accuracy_key = next((k for k in ACCURACY_KEYS if _finite(metrics.get(k))), None)
        if loss_key is None or not _finite(examples) or examples <= 0:
            return None
        others = {k: float(v) for k, v in metrics.items()  # by their own names, less the ones read as loss/accuracy
                  if k not in (WEIGHT_KEY, "examples", *LOSS_KEYS, *ACCURACY_KEYS) and _finite(v)}
        return EvalResult(float(metrics[loss_key]), float(metrics[accuracy_key]) if accuracy_key else None,
                          int(examples), others)

    def train(self, epochs: int, batch_size: int, lr: float, stop_at: float = math.inf, proximal_mu: float = 0.0,
              round_id: int = 0, max_steps: int | None = None, settings: TaskSettings | None = None) -> TrainResult:
        """One call of the app's train handler on the global arrays; UpdateRefused when its reply cannot be an update
        (none when no time is left)."""
        start = time.monotonic()
        if start >= stop_at:
            return TrainResult(0, 0, math.nan, True, 0.0)
        config: dict[str, Any] = {"server-round": int(round_id), "lr": float(lr), "local-epochs": int(epochs),
                                  "batch-size": int(batch_size),
                                  "deadline-seconds": float(min(stop_at - start, 1e9))}
        if proximal_mu:
            config["proximal-mu"] = float(proximal_mu)
        if max_steps:
            config["max-steps"] = int(max_steps)
        config.update((settings.fit_config or {}) if settings is not None else {})
        reply = self._call("train", config, settings.run_config if settings is not None else None)
        self._trained = self._arrays_of(reply)
        metrics = _metrics_of(reply, "train")
        examples = metrics.get(WEIGHT_KEY)
        if isinstance(examples, bool) or not isinstance(examples, (int, float)) or not _finite(examples) \
                or examples < 1 or float(examples) != int(examples):
            raise UpdateRefused(f"the ClientApp's train reply needs {WEIGHT_KEY!r} (a whole number >= 1) in its "
                                f"MetricRecord, got {examples!r}")
        loss = next((float(metrics[k]) for k in ("train_loss", "loss") if _finite(metrics.get(k))), math.nan)
        others = {k: float(v) for k, v in metrics.items()
                  if k not in (WEIGHT_KEY, "train_loss", "loss") and _finite(v)}
        return TrainResult(0, int(examples), loss, False, time.monotonic() - start, others)

    # ------------------------------------------------------------------ calling the app
    def _call(self, message_type: str, config: dict[str, Any], run_config: dict[str, Any] | None = None):
        """The app's reply to a ``message_type`` message carrying the global arrays and ``config`` (the Context's run
        config: ``run_config``, the task's); UpdateRefused when the app raises or replies with an error."""
        from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

        if self._global is None:
            raise RuntimeError(f"{message_type} before set_arrays()")
        context = self.context(run_config=run_config)
        arrays = ArrayRecord({name: Array(np.asarray(a)) for name, a in zip(self.names, self._global)})
        content = RecordDict({"arrays": arrays, "config": ConfigRecord(config)})
        message = Message(content=content, metadata=_delivered(context, message_type, self._round))
        try:
            reply = self.app(message, context)
        except Exception as exc:
            raise UpdateRefused(f"the ClientApp's {message_type} handler raised {type(exc).__name__}: "
                                f"{_one_line(exc)}") from None
        if not isinstance(reply, Message):
            raise UpdateRefused(f"the ClientApp's {message_type} handler returned a {type(reply).__name__}, not a "
                                "flwr.app.Message")
        if reply.has_error():
            raise UpdateRefused(f"the ClientApp's {message_type} reply carries an error: {reply.error.reason}")
        return reply

    def _arrays_of(self, reply) -> list[np.ndarray]:
        """The reply's arrays, if they are the global model's in names, shapes and dtypes; UpdateRefused otherwise."""
        records = reply.content.array_records
        if len(records) != 1:
            raise UpdateRefused(f"the ClientApp's train reply must hold exactly one ArrayRecord, it holds "
                                f"{len(records)}")
        record = next(iter(records.values()))
        try:
            arrays = [record[name].numpy() for name in record]
            names = list(record)
            problem = (f"its arrays are named {names[:4]}{'...' if len(names) > 4 else ''}, the global model's "
                       f"{self.names[:4]}{'...' if len(self.names) > 4 else ''}" if names != self.names else
                       ModelLayout.of_arrays(names, arrays).mismatch(self.layout))
        except (CodecError, ValueError, TypeError) as exc:
            problem = _one_line(exc)
        if problem:
            raise UpdateRefused(f"the ClientApp's train reply does not fit the global model: {problem}")
        return [np.ascontiguousarray(a) for a in arrays]


class FlowerAppAgent(OwnMember):
    """A deployed agent's one member, training with a Flower App's ClientApp (``trainer``): under fedpar's strategies
    when the app names its model, and answering a ServerApp's Messages (fedpar serve --flower-app) either way."""

    def __init__(self, agent_id: str, trainer: FlowerAppTrainer):
        super().__init__(agent_id, trainer)
        self.answers_messages = trainer.layout is None  # no model of its own: the runtime keeps no layout

    def answer(self, i: int, data: bytes, max_bytes: int, run_config: dict[str, Any] | None = None) -> Answer:
        """The member's reply to the Flower Message in ``data`` (``run_config``: the task's)."""
        return answer_message(self.trainer.app, data, max_bytes, self.agent_id,
                              lambda run_id: self.trainer.context(run_id, run_config))


def _delivered(context, message_type: str, round_id: int):
    """The metadata of a message as Flower's SuperLink delivers it to a node: from the server (node 1) to the
    member's node, grouped by round (an instruction message can only be built inside a ServerApp's process)."""
    from flwr.app import Metadata
    message_id = hashlib.blake2b(f"{context.node_id}:{round_id}:{message_type}:{time.time_ns()}".encode(),
                                 digest_size=16).hexdigest()
    return Metadata(run_id=context.run_id, message_id=message_id, src_node_id=SERVER_NODE_ID,
                    dst_node_id=context.node_id, reply_to_message_id="", group_id=str(round_id),
                    created_at=time.time(), ttl=MESSAGE_TTL, message_type=message_type)


def _metrics_of(reply, what: str) -> dict[str, Any]:
    """The entries of the reply's one MetricRecord; UpdateRefused when it has none or several."""
    records = reply.content.metric_records
    if len(records) != 1:
        raise UpdateRefused(f"the ClientApp's {what} reply must hold exactly one MetricRecord (with "
                            f"{WEIGHT_KEY!r}), it holds {len(records)}")
    return dict(next(iter(records.values())))


def _finite(value: Any) -> bool:
    """True for a finite int or float (not a bool)."""
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and math.isfinite(float(value))


def _one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (or its type)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
