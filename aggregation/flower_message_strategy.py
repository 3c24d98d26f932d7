"""A Flower Message-API strategy (``flwr.serverapp.strategy``: FedAvg, FedAdam, FedProx, FedMedian, Krum, ...) run
in fedpar's round loop: ``--strategy flower:FedAvg`` (a class of ``flwr.serverapp.strategy``, by name) or
``--strategy flower:package.module:Class`` (your subclass of ``flwr.serverapp.strategy.Strategy``). A class of the
legacy ``flwr.server.strategy`` goes to aggregation/flower_strategy.py, as before.

What runs, as the strategy's own ``start`` would run it, round by round:
  * the class is built with its ``--strategy-option`` values;
  * ``configure_train(round, ArrayRecord(global arrays), ConfigRecord(), grid)`` at the start of each round (FedOpt
    strategies keep the global arrays it is given): the config of its messages is what fedpar sends every member,
    ``proximal-mu`` (FedProx) as fedpar's own FedProx setting, the rest as the task's config (a ClientApp gets it
    in its ConfigRecord, a legacy Flower client in ``fit``'s config). The grid it is given only lists placeholder
    nodes: fedpar's sampler picks the cohort, with its deadline and over-selection;
  * ``aggregate_train(round, replies)`` at the close, on one reply Message per accepted upload, its content
    ``{"arrays": ArrayRecord, "metrics": MetricRecord({weighted_by_key: examples})}`` (the member's new arrays and
    the example count it claimed). A refused or late upload never reaches the strategy. An answer without arrays
    keeps the global model;
  * ``configure_evaluate(round, ...)`` beside ``configure_train``: the config of its messages goes to every member's
    evaluation (a ClientApp's evaluate handler, a legacy Flower client's ``evaluate``);
  * ``aggregate_evaluate(round, replies)`` at the close of a round whose members evaluated, on one reply per
    accepted member that reported an evaluation (a MetricRecord of its ``eval_*`` metrics without the prefix, and
    its example count): its MetricRecord is the round's ``federated_eval_*`` in place of fedpar's weighted means.
Refused in one line: the options that size the strategy's own node sample (``fraction_train``, ``min_train_nodes``,
``min_available_nodes``, ``fraction_evaluate``, ``min_evaluate_nodes``): fedpar's ``--clients-per-round``,
``--overselect`` and ``--min-available`` say who trains. Not called: ``start`` (fedpar's loop is the one that runs)
and so no ``evaluate_fn`` (the coordinator's central evaluation is fedpar's own).

Memory and rank hand-offs are as for the legacy adapter (every update of a round is held until the close).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, Metadata, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy as MessageBase

from fedpar.aggregation import flower_strategy as legacy
from fedpar.aggregation.accumulator import ShapesAndDtypes, cast_like, check_example_count
from fedpar.aggregation.options import typed_options
from fedpar.aggregation.strategy import FLOWER_PREFIX, FoldItem
from fedpar.meant import closest, did_you_mean
from fedpar.models.references import load_reference
from fedpar.protocol.flower_nodes import SERVER_NODE_ID, node_id_of
from fedpar.protocol.task_settings import TaskSettings

log = logging.getLogger("fedpar.aggregation")
FLOWER_STRATEGIES = "flwr.serverapp.strategy"  # where a bare class name (flower:FedAvg) is looked up
SAMPLING_OPTIONS = {
    "fraction_train": legacy.COHORT_FLAGS,
    "min_train_nodes": legacy.REPORT_FLAGS,
    "min_available_nodes": legacy.POPULATION_FLAGS,
    "fraction_evaluate": "--client-eval-every (the cohort of an evaluating round evaluates)",
    "min_evaluate_nodes": "--client-eval-every (the cohort of an evaluating round evaluates)",
}


def flower_class(name: str) -> type:
    """The Flower strategy class ``flower:NAME`` (a class of flwr.serverapp.strategy) or ``flower:REFERENCE``
    names: a Message-API or a legacy one; ValueError unless it is one."""
    ref = name.strip()[len(FLOWER_PREFIX):]
    if ":" not in ref:
        return _bundled_class(ref)
    cls = load_reference(ref, "Flower strategy class")
    if isinstance(cls, type) and issubclass(cls, MessageBase):
        return cls
    return legacy.flower_class(name)


def _bundled_class(ref: str) -> type:
    """The class of flwr.serverapp.strategy that ``flower:REF`` names; ValueError naming those fedpar accepts (the
    ones :func:`class_refusal` refuses whatever their options are left out)."""
    import flwr.serverapp.strategy as strategies

    cls = getattr(strategies, ref, None)
    if isinstance(cls, type) and issubclass(cls, MessageBase) and cls is not MessageBase:
        return cls
    classes = {n: c for n, c in vars(strategies).items() if isinstance(c, type) and issubclass(c, MessageBase)
               and c is not MessageBase}
    known = sorted(n for n, c in classes.items() if class_refusal(f"{FLOWER_PREFIX}{n}", c) is None)
    by_case = {n.lower(): n for n in known}  # flower:fedavg meant FedAvg
    meant = by_case.get(ref.lower()) or by_case.get(closest(ref.lower(), by_case) or "")
    raise ValueError(f"flower:{ref} is not a strategy of {FLOWER_STRATEGIES}{did_you_mean([meant])}; choose one of "
                     f"{', '.join(known)}, or give package.module:Class")


def class_refusal(name: str, cls: type) -> str | None:
    """Why fedpar refuses Message-API strategy class ``cls`` (named ``name``) whatever its options; None if it does
    not."""
    wrapped = inspect.signature(cls).parameters.get("strategy")
    if wrapped is not None and wrapped.default is wrapped.empty:
        return (f"{name} wraps another strategy instance, which options cannot build: use fedpar's --privacy "
                "central|client for differential privacy, or name a subclass that builds it "
                "(flower:package.module:Class)")
    if "train_loss_key" in inspect.signature(cls).parameters:  # QFedAvg: its every aggregate_train would raise
        return (f"{name} weighs each reply by the member's training loss, which the replies fedpar hands a strategy "
                "do not carry (only the arrays and the example count); choose another strategy")
    return None


def is_message_api(cls: type) -> bool:
    """Whether ``cls`` is a Message-API strategy (flwr.serverapp.strategy.Strategy)."""
    return isinstance(cls, type) and issubclass(cls, MessageBase)


def flower_options(name: str, cls: type, raw: dict[str, Any], from_text: bool) -> dict[str, Any]:
    """``raw`` as typed constructor options of ``cls``; the options of the strategy's own node sampling refused."""
    if not is_message_api(cls):
        return legacy.flower_options(name, cls, raw, from_text)
    options = typed_options(name, cls, raw, from_text=from_text, refused=SAMPLING_OPTIONS)
    for key in options:
        if key in SAMPLING_OPTIONS:
            raise ValueError(f"option {key!r} of {name} sizes the strategy's own node sample, which fedpar's sampler "
                             f"(with its deadline) replaces; leave it out and use {SAMPLING_OPTIONS[key]}")
    legacy.check_proximal_mu(name, options)
    return options


def build_flower_strategy(name: str, **options: Any):
    """The adapter around ``flower:...`` with constructor ``options`` (ValueError naming what is wrong)."""
    cls = flower_class(name)
    if not is_message_api(cls):
        return legacy.build_flower_strategy(name, **options)
    refusal = class_refusal(name.strip(), cls)
    if refusal:
        raise ValueError(refusal)
    return FlowerMessageStrategy(cls, name=name.strip(), **flower_options(name, cls, options, from_text=False))


class FlowerMessageStrategy(legacy.FlowerStrategy):
    """A Message-API Flower strategy (a class, built at the first round, or an instance) as a fedpar strategy: the
    round's results are held as reply Messages (the legacy adapter holds FitRes)."""

    def _build(self, global_weights: Sequence[np.ndarray]) -> MessageBase:
        """A Message-API strategy object (it gets the arrays with each round's messages)."""
        return self._factory(**self._options)

    @staticmethod
    def _saved(strategy) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The strategy's array-valued attributes, dicts of arrays included (FedOpt's moments and global arrays)."""
        return _saved_state(strategy)

    @staticmethod
    def _restore_saved(strategy, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Set back what :meth:`_saved` took."""
        _restore_state(strategy, arrays, meta)

    def client_config(self, round_id: int) -> TaskSettings:
        """``configure_train``'s message config for this round: ``proximal-mu`` as fedpar's own, the rest (less the
        ``server-round`` every member gets anyway) as the task's config."""
        assert self._global is not None, "client_config is asked after begin_round"
        strategy = self._strategy(self._global)
        _identify_as_server()
        messages = self._configured(strategy, "configure_train", round_id)
        if not messages:
            raise legacy.StrategyFailed(f"round {round_id}: {self.name}'s configure_train sent no messages "
                                        "(fraction_train 0?); fedpar's sampler picks who trains: fix the strategy")
        config = self._config_of(messages, "configure_train", round_id)
        mu = config.pop("proximal-mu", None)
        eval_config = self._config_of(self._configured(strategy, "configure_evaluate", round_id), "configure_evaluate",
                                      round_id)
        return legacy.configured_settings(self.name, round_id, "configure_train", proximal_mu=mu,
                                          fit_config=config or None, eval_config=eval_config or None)

    def _configured(self, strategy, method: str, round_id: int) -> list:
        """The messages the strategy's ``method`` (configure_train or configure_evaluate) sends this round; what it
        raises, or an answer that is no list of Messages, stops the run in one line."""
        try:
            with _quiet_flower():  # its "Sampled N nodes" lines speak of the placeholder grid
                answer = getattr(strategy, method)(round_id, self._record(self._global), ConfigRecord(),
                                                   _PlaceholderGrid(strategy))
                messages = list(answer) if isinstance(answer, Iterable) else None
        except Exception as exc:  # the strategy's own code
            raise self._failed(method, exc, round_id) from exc
        if messages is None or not all(isinstance(m, Message) for m in messages):
            raise legacy.StrategyFailed(f"round {round_id}: {self.name}'s {method} returned "
                                        f"{type(answer).__name__}, not Messages: fix the strategy")
        return messages

    def _config_of(self, messages: Sequence[Message], method: str, round_id: int) -> dict[str, Any]:
        """The ConfigRecord of the first of ``method``'s messages, less the ``server-round`` every member gets."""
        records = messages[0].content.config_records if messages else {}
        config = dict(next(iter(records.values()))) if records else {}
        config.pop("server-round", None)
        for key, value in config.items():
            if not isinstance(value, (bool, int, float, str)):
                raise legacy.StrategyFailed(f"round {round_id}: {self.name}'s {method} config {key!r} is a "
                                            f"{type(value).__name__}; fedpar sends bool, int, float and str values to "
                                            "its members: fix the strategy")
        return config

    def aggregate_evaluation(self, reports: Sequence[Mapping[str, float]]) -> dict[str, float] | None:
        """``aggregate_evaluate`` on one reply per evaluating member (a MetricRecord of its ``eval_*`` metrics, less
        the prefix, and its example count): its MetricRecord as the round's ``federated_eval_*`` (None: nothing)."""
        if self._flower is None:  # no round configured yet
            return None
        weight_key = getattr(self._flower, "weighted_by_key", "num-examples")
        replies = []
        for i, report in enumerate(reports):
            metrics = {k[len("eval_"):]: float(v) for k, v in report.items()
                       if k.startswith("eval_") and k != "eval_examples"}
            content = RecordDict({"metrics": MetricRecord({**metrics, weight_key: int(report["eval_examples"])})})
            replies.append(Message(content=content, metadata=_reply_metadata(str(i), self.round_id, "evaluate")))
        try:
            with _quiet_flower():
                aggregated = self._flower.aggregate_evaluate(self.round_id, replies)
        except Exception as exc:  # the user's code: the round keeps fedpar's means, the run goes on
            log.warning("round %d: %s.aggregate_evaluate raised %s: %s; the round's federated evaluation is fedpar's "
                        "weighted means", self.round_id, type(self._flower).__name__, type(exc).__name__, exc)
            return None
        return {f"federated_eval_{key.removeprefix('eval_')}": float(value) for key, value in (aggregated or {}).items()
                if isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
                and np.isfinite(value)} or None

    def _record(self, arrays: Sequence[np.ndarray]) -> ArrayRecord:
        """``arrays`` as an ArrayRecord named as the global model's (its names are its positions: fedpar's strategies
        see arrays in the model's order)."""
        return ArrayRecord({str(i): Array(np.asarray(a)) for i, a in enumerate(arrays)})

    def _reset_round(self, shapes: ShapesAndDtypes) -> None:
        """No replies yet."""
        self._results = []

    def _fold(self, update: Sequence[np.ndarray], num_examples: int, who: str, known_finite: bool) -> None:
        """The checked update as a reply Message (one model copy, kept until the close)."""
        assert self._shapes is not None
        arrays = self._shapes.check_update(update, who, known_finite)
        num_examples = check_example_count(num_examples, who)
        client = getattr(self._who, "client_id", "") or str(len(self._results))
        weight_key = getattr(self._flower, "weighted_by_key", "num-examples") if self._flower else "num-examples"
        content = RecordDict({"arrays": self._record(arrays), "metrics": MetricRecord({weight_key: num_examples})})
        with self._lock:
            self._results.append((client, Message(content=content, metadata=_reply_metadata(client, self.round_id))))

    def handoff(self) -> list[FoldItem]:
        """Every reply held: rank 0's strategy aggregates them all (server/ranks/)."""
        return [FoldItem(_arrays_of(reply), _weight_of(reply), client) for client, reply in self._results]

    def _finish(self, global_weights: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]]:
        """``aggregate_train`` on the round's replies; an answer without arrays keeps ``global_weights``."""
        strategy = self._strategy(global_weights)
        replies = [reply for _, reply in self._results]
        total = float(sum(_weight_of(reply) for reply in replies))
        with _quiet_flower():
            arrays, flower_metrics = strategy.aggregate_train(self.round_id, replies)
        metrics = {"num_examples": total, **legacy.flower_metrics_row(dict(flower_metrics or {}))}
        if arrays is None:
            log.warning("round %d: %s.aggregate_train returned no arrays; the global model stays", self.round_id,
                        type(strategy).__name__)
            return list(global_weights), metrics
        new = [arrays[key].numpy() for key in arrays]
        if len(new) == len(global_weights):  # a wrong count is the coordinator's to refuse, naming the layout
            new = [cast_like(a, g.dtype) if a.dtype != g.dtype and a.shape == g.shape and a.dtype.kind == "f" else a
                   for a, g in zip(new, global_weights)]
        return new, metrics


@contextlib.contextmanager
def _quiet_flower():
    """Flower's INFO lines off for the span (fedpar's round table says what happened); warnings still show."""
    flower_log = logging.getLogger("flwr")
    level = flower_log.level
    flower_log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        flower_log.setLevel(level)


def _identify_as_server() -> None:
    """Say, as Flower's ServerApp runtime does, which run and node this process's messages come from (a strategy's
    ``configure_train`` builds messages), unless something in the process has said so already."""
    from flwr.supercore.task_identity import TaskIdentity
    try:
        TaskIdentity.run_id
    except RuntimeError:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, SERVER_NODE_ID


def _saved_state(strategy: MessageBase) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """What the legacy adapter saves (arrays, lists of arrays), and every attribute holding a dict of arrays."""
    arrays, meta = legacy.saved_arrays(strategy)
    records: dict[str, list[str]] = {}
    for attr, value in vars(strategy).items():
        if isinstance(value, dict) and value and all(isinstance(v, np.ndarray) for v in value.values()):
            records[attr] = [str(k) for k in value]
            arrays.update({f"{attr}.{i}": np.asarray(v) for i, v in enumerate(value.values())})
    return arrays, {**meta, "flower_records": records}


def _restore_state(strategy: MessageBase, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Set back what :func:`_saved_state` took; ValueError naming a missing array."""
    legacy.restore_arrays(strategy, arrays, meta)
    for attr, keys in meta.get("flower_records", {}).items():
        try:
            setattr(strategy, attr, {k: np.array(arrays[f"{attr}.{i}"]) for i, k in enumerate(keys)})
        except KeyError as exc:
            raise ValueError(f"the checkpoint lacks array {exc.args[0]!r} of the Flower strategy's state") from None


def _arrays_of(reply: Message) -> list[np.ndarray]:
    """The arrays of a reply held by the adapter."""
    return [a.numpy() for a in reply.content["arrays"].values()]


def _weight_of(reply: Message) -> int:
    """The example count a reply held by the adapter carries."""
    return int(next(iter(reply.content["metrics"].values())))


def _reply_metadata(client_id: str, round_id: int, message_type: str = "train") -> Metadata:
    """Metadata of a member's reply as the ServerApp gets it (from the member's node, in the round's group)."""
    return Metadata(run_id=0, message_id=f"{round_id}:{message_type}:{client_id}", src_node_id=node_id_of(client_id),
                    dst_node_id=SERVER_NODE_ID, reply_to_message_id="", group_id=str(round_id),
                    created_at=time.time(), ttl=43_200.0, message_type=message_type)


class _PlaceholderGrid(Grid):
    """What ``configure_train`` samples from: as many placeholder nodes as the strategy wants to see (fedpar's
    sampler picks the real cohort); every other call is refused."""

    def __init__(self, strategy: MessageBase) -> None:
        wanted = [getattr(strategy, k, 1) for k in ("min_available_nodes", "min_train_nodes")]
        self._nodes = list(range(2, 2 + max([1] + [int(w) for w in wanted if isinstance(w, (int, float))])))

    def get_node_ids(self) -> Iterable[int]:
        """The placeholder nodes."""
        return list(self._nodes)

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError("fedpar's coordinator sends the messages itself; a Flower strategy run in "
                                  "fedpar's loop only configures and aggregates")

    set_run = create_message = push_messages = pull_messages = send_and_receive = _refuse

    @property
    def run(self):
        """Refused (see :meth:`_refuse`)."""
        return self._refuse()
