"""A Flower ``Strategy`` run inside fedpar's coordinator: ``--strategy flower:package.module:Class`` (or
``flower:path/file.py:Class``), for aggregation rules fedpar lacks (FedAvgM as Flower writes it, FedTrimmedAvg,
FedMedian, Krum, Bulyan, QFedAvg, your own subclass).

What runs, as Flower's own server would run it:
  * the class is built at the first round with its ``--strategy-option`` values and, when its constructor takes
    ``initial_parameters``, fedpar's global model; ``initialize_parameters`` is called once, as Flower's server
    does (its answer is not used: fedpar's model is the initial global);
  * ``configure_fit(round, empty parameters, one placeholder client)`` each round, for its config only: fedpar
    sends one config to every agent. ``proximal_mu`` becomes fedpar's own FedProx setting (fedpar's trainers add
    the proximal term), every other key travels as ``fit_config`` (Flower clients run by fedpar get it in
    ``fit``'s config);
  * ``aggregate_fit(round, results, [])`` at the close, on one ``(ClientProxy, FitRes)`` per accepted upload
    (``FitRes.parameters``: the agent's new weights, ``num_examples``: its claimed example count, ``metrics``:
    empty, since fedpar aggregates the agents' metrics itself). Failures are always empty: a refused or late
    upload never reaches a strategy. A ``None`` answer keeps the old global model. Float arrays of the answer are
    cast to the model's dtypes.
What the strategy's own code raises (its constructor, ``initialize_parameters``, ``configure_fit``, the round's
aggregation), an answer of the wrong kind, and arrays that cannot be the global model (another layout, NaN or Inf)
stop the run with one line naming the method and the strategy (:class:`StrategyFailed`); the global model stays the
last good one.
Not used: Flower's client sampling (fedpar's sampler picks each cohort, so options that size Flower's sample,
``fraction_fit``, ``min_fit_clients``, ... are refused), and the evaluate side (``configure_evaluate``,
``aggregate_evaluate``, ``evaluate``): fedpar's agents evaluate the global model before training and the
coordinator evaluates centrally.

Memory: Flower's interface needs every update of the round at once. The adapter serializes each accepted update
into its FitRes as it is folded (one model copy per update: K models for K updates, kept until the close), against
fedpar's streaming strategies' one running sum whatever K. At the close Flower's FedAvg (and FedProx, FedOpt)
decodes one update at a time (about 3 models more); rules built on ``flwr...aggregate()`` (FedAvgM, FedTrimmedAvg,
...) decode and weigh all K at once (about 2 K more). Measured (benchmarks/flower_strategy_memory.py, 10 updates):
peaks of 13 models for Flower's FedAvg, 32 for FedAvgM, 41 for FedTrimmedAvg, against 4 for fedpar's FedAvg.
Size the cohort (``--clients-per-round``, ``--overselect``) with that in mind.

With ``--aggregator-ranks`` above 1 the other ranks hand their results to rank 0 at the close, which aggregates them
all. ``--secure-aggregation`` and ``--privacy`` give the coordinator one masked or noisy sum, never one update per
agent: Flower's FedAvg, FedAvgM, FedProx and its FedOpt family (:data:`LINEAR_CLASSES`) step from the example-weighted
mean of the round's results alone, so they are handed that sum as one result, as Flower's own SecAgg+ workflow hands
it; the other strategies are refused with the reason (aggregation/compatibility.py).
Upload compression works: a compressed upload is decoded into the agent's new weights before it is folded.

Checkpoints: the strategy's array-valued attributes (momentum, Adam moments, the running global model), as
arrays; scalar attributes are constructor settings and come from the options again. State kept elsewhere
(in closures, in nested objects) starts afresh after a restart.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy as FlowerBase

from fedpar.aggregation.accumulator import ShapesAndDtypes, cast_like, check_example_count
from fedpar.aggregation.options import option_specs, typed_options
from fedpar.aggregation.errors import NoUpdatesError
from fedpar.aggregation.strategy import FLOWER_PREFIX, FoldItem, Strategy
from fedpar.models.references import load_reference
from fedpar.protocol.task_settings import TaskSettings
from fedpar.task import TaskFailed, raised

log = logging.getLogger("fedpar.aggregation")
# What sets in fedpar what a Flower strategy's own sampling options set; both commands' flags, as each has its own.
COHORT_FLAGS = "--clients-per-round (serve: also --fraction)"
REPORT_FLAGS = "--clients-per-round and --min-reports"
POPULATION_FLAGS = "--min-available (serve) / --clients (simulate)"
# Constructor options that size Flower's own client sample, and what sets the same thing in fedpar.
SAMPLING_OPTIONS = {
    "fraction_fit": COHORT_FLAGS,
    "min_fit_clients": REPORT_FLAGS,
    "min_available_clients": POPULATION_FLAGS,
    "fraction_evaluate": "nothing (agents evaluate the global model in every task)",
    "min_evaluate_clients": "nothing (agents evaluate the global model in every task)",
}
MEMORY_NOTE = ("holds every update of the round as Flower requires (one serialized model per update in its FitRes); "
               "at the close Flower decodes them: about K + 3 models for K updates under its FedAvg, 3 K + 2 under "
               "rules built on flwr's aggregate() (FedAvgM, FedTrimmedAvg)")


class StrategyFailed(TaskFailed):
    """The Flower strategy's own code raised, or answered what fedpar cannot use: the run stops in one line."""


def flower_class(name: str) -> type:
    """The Flower Strategy class ``flower:REFERENCE`` names; ValueError unless it is one."""
    ref = name.strip()[len(FLOWER_PREFIX):]
    cls = load_reference(ref, "Flower strategy class")
    if not (isinstance(cls, type) and issubclass(cls, FlowerBase)):
        raise ValueError(f"{ref!r} is not a Flower strategy class (a subclass of flwr.server.strategy.Strategy)")
    return cls


def flower_options(name: str, cls: type, raw: dict[str, Any], from_text: bool) -> dict[str, Any]:
    """``raw`` as typed constructor options of ``cls``; refuses the options of Flower's client sampling."""
    options = typed_options(name, cls, raw, from_text=from_text)
    for key in options:
        if key in SAMPLING_OPTIONS:
            raise ValueError(f"option {key!r} of {name} sizes Flower's client sample, which fedpar's sampler "
                             f"replaces; leave it out and use {SAMPLING_OPTIONS[key]}")
    if "initial_parameters" in options:
        raise ValueError(f"option 'initial_parameters' of {name}: the initial global model is the coordinator's")
    check_proximal_mu(name, options)
    return options


def check_proximal_mu(name: str, options: dict[str, Any]) -> None:
    """ValueError for a ``proximal_mu`` option below 0 (fedpar's agents take it as their own: none can train so)."""
    mu = options.get("proximal_mu")
    if isinstance(mu, (int, float)) and not (mu >= 0 and math.isfinite(mu)):
        raise ValueError(f"option 'proximal_mu' of {name} must be >= 0, got {mu}")


def configured_settings(name: str, round_id: int, method: str, **settings: Any) -> TaskSettings:
    """The TaskSettings a strategy's ``method`` configured for round ``round_id``; StrategyFailed, naming it, for
    values no agent can train with (a negative proximal_mu)."""
    try:
        return TaskSettings(**settings)
    except ValueError as exc:
        raise StrategyFailed(f"round {round_id}: {name}'s {method} config: {exc}; fix the strategy") from None


def build_flower_strategy(name: str, **options: Any) -> FlowerStrategy:
    """The adapter around ``flower:REFERENCE`` with constructor ``options`` (ValueError naming what is wrong)."""
    cls = flower_class(name)
    return FlowerStrategy(cls, name=name.strip(), **flower_options(name, cls, options, from_text=False))


# Flower's strategies whose new model depends on a round's results only through their example-weighted mean: FedAvg
# and those that step from its mean (FedAvgM's momentum, FedProx, the FedOpt family's server optimizers), in both of
# Flower's APIs. One result carrying that mean and the total example count gives them the same model. The classes
# themselves: a subclass may aggregate otherwise.
LINEAR_CLASSES = tuple(f"{module}:{name}" for module in ("flwr.server.strategy", "flwr.serverapp.strategy")
                       for name in ("FedAvg", "FedAvgM", "FedProx", "FedOpt", "FedAdam", "FedAdagrad", "FedYogi"))


def linear_flower_class(cls: type) -> bool:
    """Whether Flower strategy class ``cls`` is one of :data:`LINEAR_CLASSES`."""
    return f"{cls.__module__.rsplit('.', 1)[0]}:{cls.__qualname__}" in LINEAR_CLASSES \
        or f"{cls.__module__}:{cls.__qualname__}" in LINEAR_CLASSES


def _bind_refusal(name: str, cls: type, options: dict, exc: TypeError) -> str:
    """The line refusing Flower class ``cls``'s constructor arguments ``options``: for a required one left out, how
    to give it (a --strategy-option where it takes a number, text or flag; else a subclass that builds it)."""
    missing = [p.name for p in inspect.signature(cls).parameters.values()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.name not in options and p.name != "initial_parameters"]
    if not missing:
        return f"bad options for {name}: {exc}"
    settable = option_specs(cls)
    if all(m in settable for m in missing):
        given = " ".join(f"--strategy-option {m}=VALUE" for m in missing)
        return f"{name} needs {', '.join(map(repr, missing))} (no default); give {given}"
    objects = [m for m in missing if m not in settable]
    return (f"{name} needs {', '.join(map(repr, objects))}, which no --strategy-option can give (not a number, text "
            "or flag); give a subclass of your own that builds it, e.g. --strategy flower:my_strategy.py:MyStrategy")


def _check_values(name: str, cls: type, options: dict, extra: dict) -> None:
    """ValueError, before the rounds, when Flower class ``cls`` refuses the values of its ``options`` (its constructor
    raises ValueError, as FedTrimmedAvg's does for a beta outside [0, 0.5)); it is built for the rounds only at the
    first, on the global model, so anything else it raises here is left to that build to say."""
    flower_log = logging.getLogger("flwr")
    quiet, flower_log.disabled = flower_log.disabled, True  # its notes (a deprecation, mu 0) come at the real build
    try:
        cls(**options, **extra)
    except ValueError as exc:
        raise ValueError(f"{name} refused its options: {exc} (check --strategy-option)") from None
    except Exception:  # noqa: BLE001 (its own code may want the real initial model: the first round's build says)
        pass
    finally:
        flower_log.disabled = quiet


class FlowerStrategy(Strategy):
    """A Flower ``Strategy`` (a class, built at the first round, or an instance) as a fedpar strategy."""

    memory_note = MEMORY_NOTE
    linear = False  # Flower's aggregate_fit is handed one FitRes per agent
    configures_from_round = True  # configure_fit (configure_train) is given the round's global model

    def __init__(self, strategy: type | FlowerBase, name: str = "", **options: Any) -> None:
        """Wrap ``strategy``: a class (``options`` go to its constructor) or a ready instance (no options)."""
        super().__init__()
        if isinstance(strategy, type):
            params = inspect.signature(strategy).parameters
            extra = {"initial_parameters": Parameters([], "numpy.ndarray")} if "initial_parameters" in params else {}
            try:
                inspect.signature(strategy).bind(**options, **extra)
            except TypeError as exc:
                raise ValueError(_bind_refusal(name or strategy.__name__, strategy, options, exc)) from None
            _check_values(name or strategy.__name__, strategy, options, extra)
            self._flower: FlowerBase | None = None
        elif options:
            raise ValueError("options go to a Flower strategy class, not to an instance built already")
        else:
            self._flower = strategy
        self._factory = strategy if isinstance(strategy, type) else None
        self._options = options
        cls = strategy if isinstance(strategy, type) else type(strategy)
        self.name = name or f"{FLOWER_PREFIX}{cls.__module__}:{cls.__qualname__}"
        self._linear_class = linear_flower_class(cls)
        self._results: list[tuple[ClientProxy, FitRes]] = []
        self._pending_state: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None
        self._who = threading.local()  # the client id of the fold running on this thread

    def secure_sum_refusal(self) -> str | None:
        """None for :data:`LINEAR_CLASSES` (the unmasked sum is handed over as one result), else why."""
        if self._linear_class:
            return None
        return (f"secure aggregation reveals only the weighted mean, and {self.name}'s aggregation needs each agent's "
                "result")

    # ------------------------------------------------------------------ the Flower object
    def _strategy(self, global_weights: Sequence[np.ndarray]) -> FlowerBase:
        """The Flower strategy, built on first use on top of ``global_weights`` (and its saved state restored)."""
        if self._flower is None:
            try:
                self._flower = self._build(global_weights)
            except Exception as exc:  # the user's constructor or initialize_parameters
                raise self._failed("constructor or initialize_parameters", exc) from exc
        if self._pending_state is not None:
            self._restore_saved(self._flower, *self._pending_state)
            self._pending_state = None
        return self._flower

    def _build(self, global_weights: Sequence[np.ndarray]) -> FlowerBase:
        """A legacy strategy object, initialised on ``global_weights``."""
        extra = {}
        if "initial_parameters" in inspect.signature(self._factory).parameters:
            extra["initial_parameters"] = ndarrays_to_parameters(list(global_weights))
        flower = self._factory(**self._options, **extra)
        flower.initialize_parameters(_OneClientManager())
        return flower

    @staticmethod
    def _saved(strategy) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The strategy's state as named arrays and their kinds."""
        return saved_arrays(strategy)

    @staticmethod
    def _restore_saved(strategy, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Set back what :meth:`_saved` took."""
        restore_arrays(strategy, arrays, meta)

    def client_config(self, round_id: int) -> TaskSettings:
        """``configure_fit``'s config for this round: ``proximal_mu`` as fedpar's own, the rest as ``fit_config``."""
        assert self._global is not None, "client_config is asked after begin_round"
        strategy = self._strategy(self._global)
        try:
            pairs = strategy.configure_fit(round_id, Parameters([], "numpy.ndarray"), _OneClientManager())
        except Exception as exc:
            raise self._failed("configure_fit", exc, round_id) from exc
        config = self._fit_config(pairs, round_id)
        mu = config.pop("proximal_mu", None)
        return configured_settings(self.name, round_id, "configure_fit", proximal_mu=mu, fit_config=config or None)

    def _fit_config(self, pairs: Any, round_id: int) -> dict[str, Any]:
        """The config of ``configure_fit``'s first (ClientProxy, FitIns) pair; StrategyFailed unless it is one."""
        if not pairs:
            return {}
        first = pairs[0] if isinstance(pairs, list) else None
        if not (isinstance(first, tuple) and len(first) == 2 and isinstance(first[1], FitIns)
                and isinstance(first[1].config, dict)):
            raise StrategyFailed(f"round {round_id}: {self.name}'s configure_fit returned {_kind(pairs)}, not a list "
                                 "of (ClientProxy, FitIns) pairs: fix the strategy")
        config = dict(first[1].config)
        for key, value in config.items():
            if not isinstance(value, (bool, int, float, str)):
                raise StrategyFailed(f"round {round_id}: {self.name}'s configure_fit config {key!r} is a "
                                     f"{type(value).__name__}; fedpar sends bool, int, float and str values to its "
                                     "agents: fix the strategy")
        return config

    def _failed(self, method: str, exc: BaseException, round_id: int = 0) -> StrategyFailed:
        """The one line for what the strategy's ``method`` raised (in round ``round_id``; 0: before the rounds)."""
        where = f"round {round_id}: " if round_id else ""
        return StrategyFailed(f"{where}{self.name}'s {method} raised {raised(exc)}: fix the strategy")

    # ------------------------------------------------------------------ the round
    def fold(self, update: Sequence[np.ndarray], num_examples: int, client_id: str = "",
             members: Sequence[str] = (), *, known_finite: bool = False, clipped: bool | None = None) -> None:
        """As :meth:`Strategy.fold`; the client id becomes the ClientProxy's ``cid``."""
        self._who.client_id = client_id
        super().fold(update, num_examples, client_id, members, known_finite=known_finite, clipped=clipped)

    def _reset_round(self, shapes: ShapesAndDtypes) -> None:
        """No results yet."""
        self._results = []

    def _fold(self, update: Sequence[np.ndarray], num_examples: int, who: str, known_finite: bool) -> None:
        """Serialize the checked update into a FitRes (one model copy, kept until the close)."""
        assert self._shapes is not None
        arrays = self._shapes.check_update(update, who, known_finite)
        num_examples = check_example_count(num_examples, who)
        fit = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), num_examples, {})
        proxy = _AgentProxy(getattr(self._who, "client_id", "") or str(len(self._results)))
        with self._lock:
            self._results.append((proxy, fit))

    def handoff(self) -> list[FoldItem]:
        """Every result held: rank 0's Flower strategy aggregates them all (server/ranks/)."""
        return [FoldItem(parameters_to_ndarrays(fit.parameters), fit.num_examples, proxy.cid)
                for proxy, fit in self._results]

    def take_handoff(self, items: Sequence[FoldItem]) -> None:
        """Another rank's results, with their example counts and client ids."""
        for item in items:
            self.fold(item.update, int(round(item.num_examples)), item.client_id)

    def _num_folded(self) -> int:
        """Results held for the close."""
        return len(self._results)

    def finish(self) -> tuple[list[np.ndarray], dict[str, float]]:
        """As :meth:`Strategy.finish`; what the Flower strategy raises at the close, or a model it answers that
        cannot be the global model, stops the run in one line."""
        round_id, shapes = self.round_id, self._shapes
        try:
            new, metrics = super().finish()
        except (StrategyFailed, NoUpdatesError):
            raise
        except Exception as exc:  # the user's aggregation (or its answer), not a round that may fail and go on
            raise self._failed("aggregation", exc, round_id) from exc
        assert shapes is not None
        return self._usable(new, shapes, round_id, "aggregation"), metrics

    def _finish(self, global_weights: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]]:
        """``aggregate_fit`` on the round's results; a None answer keeps ``global_weights``."""
        strategy = self._strategy(global_weights)
        total = float(sum(fit.num_examples for _, fit in self._results))
        answer = strategy.aggregate_fit(self.round_id, list(self._results), [])
        if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], (Parameters, type(None)))
                and isinstance(answer[1], (dict, type(None)))):
            raise StrategyFailed(f"round {self.round_id}: {self.name}'s aggregate_fit returned {_kind(answer)}, not "
                                 "a (Parameters or None, dict of metrics) pair: fix the strategy")
        parameters, flower_metrics = answer
        metrics = {"num_examples": total, **flower_metrics_row(flower_metrics)}
        if parameters is None:
            log.warning("round %d: %s.aggregate_fit returned no parameters; the global model stays",
                        self.round_id, type(strategy).__name__)
            return list(global_weights), metrics
        return self._checked(parameters_to_ndarrays(parameters), global_weights, "aggregate_fit"), metrics

    def _checked(self, new: list[np.ndarray], global_weights: list[np.ndarray], method: str) -> list[np.ndarray]:
        """``new`` with float arrays cast to the model's dtypes; StrategyFailed unless it fits the model, finite."""
        if len(new) == len(global_weights):
            new = [cast_like(a, g.dtype) if a.dtype != g.dtype and a.shape == g.shape and a.dtype.kind == "f" else a
                   for a, g in zip(new, global_weights)]
        return self._usable(new, ShapesAndDtypes.of(global_weights), self.round_id, method)

    def _usable(self, new: list[np.ndarray], shapes: ShapesAndDtypes, round_id: int, method: str) -> list[np.ndarray]:
        """``new`` if it has the model's layout and is finite; StrategyFailed naming what is wrong otherwise."""
        try:
            new = shapes.check(new, f"{self.name}'s {method}")
        except ValueError as exc:
            raise StrategyFailed(f"round {round_id}: {exc}, which cannot be the global model: fix the strategy") \
                from None
        bad = next((i for i, a in enumerate(new) if a.dtype.kind == "f" and not np.isfinite(a).all()), None)
        if bad is not None:
            raise StrategyFailed(f"round {round_id}: {self.name}'s {method} returned NaN or Inf in array {bad}, "
                                 "which cannot be the global model: fix the strategy")
        return new

    def _drop_round(self) -> None:
        """Release the round's results."""
        self._results = []

    # ------------------------------------------------------------------ cross-round state
    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The Flower strategy's array-valued attributes (see the module docstring)."""
        if self._flower is None:
            return self._pending_state or ({}, {})
        return self._saved(self._flower)

    def _load_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Restore them when the Flower strategy is built (or now, if it is)."""
        self._pending_state = (dict(arrays), dict(meta))
        if self._flower is not None:
            self._restore_saved(self._flower, arrays, meta)
            self._pending_state = None


def _kind(value: Any) -> str:
    """What ``value`` is, for a line saying it is not what was expected: 'None', 'a list of 2 str', 'a dict'."""
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        inner = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {len(value)} {'/'.join(inner)}".rstrip()
    return f"a {type(value).__name__}"


def flower_metrics_row(metrics: dict[str, Any]) -> dict[str, float]:
    """Finite numeric entries of Flower's metrics, named ``flower_KEY`` (for the round's metrics row)."""
    out = {}
    for key, value in (metrics or {}).items():
        if isinstance(value, (bool, int, float, np.number)) and math.isfinite(float(value)):
            out[f"flower_{key}"] = float(value)
    return out


def saved_arrays(strategy: FlowerBase) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every attribute holding an array, a list of arrays or Parameters: as named arrays plus their kinds."""
    arrays: dict[str, np.ndarray] = {}
    kinds: dict[str, list] = {}
    for attr, value in vars(strategy).items():
        if isinstance(value, Parameters):
            kind, values = "parameters", parameters_to_ndarrays(value)
        elif isinstance(value, np.ndarray):
            kind, values = "ndarray", [value]
        elif isinstance(value, list) and value and all(isinstance(v, np.ndarray) for v in value):
            kind, values = "ndarrays", value
        else:
            continue
        kinds[attr] = [kind, len(values)]
        arrays.update({f"{attr}.{i}": np.asarray(v) for i, v in enumerate(values)})
    return arrays, {"flower_arrays": kinds}


def restore_arrays(strategy: FlowerBase, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Set back what :func:`saved_arrays` took; ValueError naming a missing array."""
    for attr, (kind, count) in meta.get("flower_arrays", {}).items():
        try:
            values = [np.array(arrays[f"{attr}.{i}"]) for i in range(int(count))]
        except KeyError as exc:
            raise ValueError(f"the checkpoint lacks array {exc.args[0]!r} of the Flower strategy's state") from None
        value = ndarrays_to_parameters(values) if kind == "parameters" else values[0] if kind == "ndarray" \
            else values
        setattr(strategy, attr, value)


class _AgentProxy(ClientProxy):
    """A fedpar agent as Flower's results name it; fedpar runs the agent's fit itself, so the calls are refused."""

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError("fedpar's coordinator talks to its agents itself; a Flower strategy run by "
                                  "fedpar only aggregates")

    get_properties = get_parameters = fit = evaluate = reconnect = _refuse


class _OneClientManager(ClientManager):
    """One placeholder client standing for the whole cohort: fedpar's sampler picks the agents, and every agent
    gets the same config, so ``configure_fit`` needs to configure one."""

    def __init__(self) -> None:
        self._client = _AgentProxy("cohort")

    def num_available(self) -> int:
        """One."""
        return 1

    def register(self, client: ClientProxy) -> bool:
        """Nothing registers here."""
        return False

    def unregister(self, client: ClientProxy) -> None:
        """Nothing to unregister."""

    def all(self) -> dict[str, ClientProxy]:
        """The placeholder."""
        return {self._client.cid: self._client}

    def wait_for(self, num_clients: int, timeout: int = 86400) -> bool:
        """Never waits."""
        return True

    def sample(self, num_clients: int, min_num_clients: int | None = None, criterion=None) -> list[ClientProxy]:
        """The placeholder, whatever the sample size asked."""
        return [self._client]
