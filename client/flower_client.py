"""An unchanged Flower ``NumPyClient`` as a fedpar agent's trainer: ``fedpar client --flower-client module:fn``.

The agent (client/agent.py) brings fedpar's transport, mutual TLS, deadline, compression and secure aggregation;
:class:`FlowerTrainer` only calls the client's own methods, with NumPy arrays and a config dict as Flower does:
  * ``fn(context)`` makes the client once, as Flower's ``ClientApp`` calls its ``client_fn``: ``context.node_config``
    holds ``partition-id`` and ``num-partitions`` (the agent's ``--partition-index`` and ``--num-partitions``) and
    ``agent-id``; ``run_config`` is empty. It may return the NumPyClient or the Client its ``to_client()`` makes;
  * ``get_parameters({})`` once at start: its arrays must match the coordinator's model in order, shape and dtype
    (the agent's ``--model`` names them), or the agent stops with one line naming the first difference;
  * each task, ``evaluate(global, {"server_round": r})`` on the global model (Flower's default answer, 0 examples,
    reports nothing), then ``fit(global, config)`` with config ``server_round``, ``local_epochs``, ``batch_size``,
    ``learning_rate``, ``deadline_seconds`` (seconds the client may train before the agent must upload),
    ``proximal_mu`` (FedProx), ``max_steps`` (when capped) and the Flower strategy's own ``configure_fit`` config
    (``--strategy flower:...``). Its arrays are checked as ``get_parameters``' are; its ``num_examples`` is the
    update's weight and its metrics ``train_loss`` (or ``loss``) is reported as the agent's train loss.
What the client's own code raises as the agent starts (``fn``, ``get_parameters``, ``get_properties``) stops the
agent in one line; an answer of the wrong kind from ``fit`` or ``evaluate`` refuses that task with one line saying
what Flower expects (``(arrays, num_examples, metrics)``, ``(loss, num_examples, metrics)``).
fit cannot be interrupted: a client that ignores ``deadline_seconds`` and finishes late has its update refused as
late, like any agent's. The coordinator needs the training set's size when the agent joins (it bounds the example
counts the agent may claim): pass it (``--flower-examples N``) or return ``{"num_examples": N}`` from
``get_properties``.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedpar.client.local_loop import TrainResult
from fedpar.client.trainer_protocol import HeldArrays
from fedpar.models.references import load_reference
from fedpar.protocol.codec import CodecError, ModelLayout
from fedpar.protocol.task_settings import TaskSettings
from fedpar.task import raised
from fedpar.tasks.evaluation import EvalResult

Spec = tuple[str, str, tuple[int, ...]]


class FlowerClientError(ValueError):
    """A Flower client that cannot take part as it is (wrong arrays, no example count): one line saying why."""


def flower_context(agent_id: str, partition_index: int = 0, num_partitions: int = 1):
    """The ``flwr.common.Context`` a ``client_fn`` gets, for this agent and its partition."""
    from flwr.app import RecordDict
    from flwr.common import Context
    node_config = {"partition-id": int(partition_index), "num-partitions": int(num_partitions), "agent-id": agent_id}
    return Context(run_id=0, node_id=zlib.crc32(agent_id.encode()), node_config=node_config, state=RecordDict(),
                   run_config={})


def load_flower_client(ref: str, context) -> Any:
    """The NumPyClient that the function ``ref`` (``module:fn`` or ``file.py:fn``) returns for ``context``."""
    fn = load_reference(ref, "client function")
    if not callable(fn):
        raise FlowerClientError(f"{ref!r} is not a function (it should take a Flower Context and return a client)")
    try:
        client = fn(context)
    except Exception as exc:  # the user's client_fn: its data or model could not be made
        raise FlowerClientError(f"the client function {ref} raised {raised(exc)}: fix the client") from exc
    return numpy_client_of(client, ref)


def numpy_client_of(client: Any, origin: str = "the client function") -> Any:
    """``client`` as a NumPyClient (unwrapping what ``NumPyClient.to_client()`` returns); FlowerClientError else."""
    from flwr.client import NumPyClient
    client = getattr(client, "numpy_client", client)
    if not isinstance(client, NumPyClient):
        raise FlowerClientError(f"{origin} returned a {type(client).__name__}, not a flwr.client.NumPyClient; "
                                "fedpar runs NumPyClients")
    return client


class FlowerTrainer(HeldArrays):
    """The agent's trainer protocol (client/agent.py) over a Flower NumPyClient; the global model's names come
    from ``specs``, the (name, dtype, shape) of the coordinator's model."""

    framework = "flower"
    reads_task_settings = True  # fit's config carries the Flower strategy's configure_fit config

    def __init__(self, client: Any, specs: Sequence[Spec], num_examples: int | None = None):
        """Check the client's ``get_parameters`` against ``specs``; take ``num_examples`` or its properties'."""
        self.client = numpy_client_of(client)
        self.layout = ModelLayout(specs)
        self._check(self._call("get_parameters", config={}), "get_parameters()")
        self.num_examples = self._examples(num_examples)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The client's ``method`` called as Flower calls it; FlowerClientError naming what it raised."""
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except Exception as exc:
            raise FlowerClientError(f"the Flower client's {method}() raised {raised(exc)}: fix the client") from exc

    def _examples(self, given: int | None) -> int:
        """The training set's size, declared at Join."""
        count = given
        if count is None:
            properties = self._call("get_properties", config={})
            count = properties.get("num_examples") if isinstance(properties, dict) else None
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise FlowerClientError("fedpar needs the Flower client's training set size when the agent joins: pass "
                                    "--flower-examples N, or return {'num_examples': N} from its get_properties "
                                    f"(got {count!r})")
        return int(count)

    def _check(self, arrays: Any, what: str) -> list[np.ndarray]:
        """``arrays`` if they are the coordinator's model in order, shape and dtype; FlowerClientError naming the
        first difference otherwise."""
        if not isinstance(arrays, (list, tuple)) or not all(isinstance(a, np.ndarray) for a in arrays):
            raise FlowerClientError(f"the Flower client's {what} must return a list of NumPy arrays, "
                                    f"got {type(arrays).__name__}")
        names = [t.name for t in self.layout.tensors]
        try:
            problem = (f"expected {len(names)} arrays, got {len(arrays)}" if len(arrays) != len(names) else
                       ModelLayout.of_arrays(names, arrays).mismatch(self.layout))
        except CodecError as exc:
            problem = str(exc)
        if problem:
            raise FlowerClientError(f"the Flower client's {what} does not fit the coordinator's model: {problem}")
        return [np.ascontiguousarray(a) for a in arrays]

    # ------------------------------------------------------------------ the agent's trainer protocol
    def array_specs(self) -> list[Spec]:
        """(name, dtype, shape) of the model's arrays."""
        return self.layout.specs()

    def evaluate(self, settings: TaskSettings | None = None) -> EvalResult | None:
        """The client's evaluate on the global model (its config: ``server_round`` and a Flower strategy's
        configure_evaluate config): loss, ``accuracy`` when its metrics have one."""
        config = {"server_round": self._round, **((settings.eval_config or {}) if settings is not None else {})}
        loss, examples, metrics = _answer(self.client.evaluate(self._global, config), "evaluate",
                                          "(loss, num_examples, metrics)")
        if isinstance(loss, bool) or not isinstance(loss, (int, float, np.number)) or isinstance(examples, bool) \
                or not isinstance(examples, (int, np.integer)):
            raise FlowerClientError("the Flower client's evaluate() must return a number as its loss and a whole "
                                    f"number of examples, got {loss!r} and {examples!r}: fix the client")
        if not examples or not math.isfinite(float(loss)):
            return None
        accuracy = metrics.get("accuracy")
        accuracy = float(accuracy) if _finite_number(accuracy) else None
        return EvalResult(float(loss), accuracy, int(examples))

    def train(self, epochs: int, batch_size: int, lr: float, stop_at: float = math.inf, proximal_mu: float = 0.0,
              round_id: int = 0, max_steps: int | None = None, settings: TaskSettings | None = None) -> TrainResult:
        """One ``fit`` of the client on the global weights (none when no time is left)."""
        start = time.monotonic()
        if start >= stop_at:
            return TrainResult(0, 0, math.nan, True, 0.0)
        config: dict[str, Any] = {"server_round": int(round_id), "local_epochs": int(epochs),
                                  "batch_size": int(batch_size), "learning_rate": float(lr),
                                  "deadline_seconds": float(stop_at - start)}
        if proximal_mu:
            config["proximal_mu"] = float(proximal_mu)
        if max_steps:
            config["max_steps"] = int(max_steps)
        config.update((settings.fit_config or {}) if settings is not None else {})
        arrays, examples, metrics = _answer(self.client.fit(self._global, config), "fit",
                                            "(arrays, num_examples, metrics)")
        self._trained = self._check(arrays, "fit()")
        if isinstance(examples, bool) or not isinstance(examples, (int, np.integer)) or examples < 0:
            raise FlowerClientError(f"the Flower client's fit() must return a whole number of examples, "
                                    f"got {examples!r}")
        loss = next((float(metrics[k]) for k in ("train_loss", "loss") if _finite_number(metrics.get(k))), math.nan)
        steps = int(metrics["steps"]) if isinstance(metrics.get("steps"), int) and metrics["steps"] >= 0 else 0
        return TrainResult(steps, int(examples), loss, False, time.monotonic() - start)


def _answer(answer: Any, method: str, form: str) -> tuple[Any, Any, dict]:
    """``answer`` as the three values Flower's ``method`` returns, its metrics a dict; FlowerClientError else."""
    if not (isinstance(answer, (tuple, list)) and len(answer) == 3 and isinstance(answer[2], (dict, type(None)))):
        got = f"a {type(answer).__name__}" + (f" of {len(answer)}" if isinstance(answer, (tuple, list)) else "")
        if isinstance(answer, (tuple, list)) and len(answer) == 3:
            got += f" whose metrics are a {type(answer[2]).__name__}"
        raise FlowerClientError(f"the Flower client's {method}() must return {form}, three values with a dict of "
                                f"metrics, got {'None' if answer is None else got}: fix the client")
    return answer[0], answer[1], answer[2] or {}


def _finite_number(value: Any) -> bool:
    """True for a finite int or float (not a bool)."""
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and math.isfinite(float(value))
