"""What a training task carries: its local-training knobs (TrainTask's own fields: :class:`LocalTraining`, declared
once, so ``serve`` and ``simulate`` have the same defaults), and every setting beyond them as one typed value (the
wire's extra_json: :class:`TaskSettings`).

The coordinator builds a :class:`TaskSettings` per round (strategy, upload compression, round mode) and sends
``to_json()``; the agent reads it back with ``from_json``: those are the only two places the JSON is written
and read. Both ends validate types and ranges, and an agent refuses a key it does not know. A TaskSettings
also reads as the mapping of the keys it sends (unset fields are left out), so it compares equal to that dict.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from fedpar.settings import NOTED, setting

COMPRESSION_METHODS = ("none", "fp16", "bf16", "int8", "topk")
MAX_JSON_CHARS = 64 << 10
MAX_TASK_ROUND = 2 ** 48  # a member's shuffle is seeded from the round: a larger one overflows the seed
MAX_TASK_SECONDS = 1e9  # about 31 years: a longer deadline overflows gRPC's and threading's timeouts


@dataclass
class LocalTraining:
    """What an agent does with a task: E local epochs of SGD over batches of B at learning rate lr."""

    local_epochs: int = setting(5, check="task_count", group="training", help="local epochs per task (E)", resume=NOTED)
    batch_size: int = setting(16, check="task_count", group="training", help="local batch size (B)", resume=NOTED)
    learning_rate: float = setting(0.1, check="positive", flag="lr", group="training",
                                   help="local SGD learning rate", resume=NOTED)
    client_eval_every: int = setting(
        1, check="non_negative_int", group="training",
        help="agents score the received global model on their validation split (federated evaluation) in every "
             "N-th round; 0: never (the central evaluation is kept)", resume=NOTED)

    def evaluates_in(self, round_id: int) -> bool:
        """Whether the agents of round ``round_id`` evaluate the global model they receive."""
        return self.client_eval_every > 0 and round_id % self.client_eval_every == 0


def check_task_knobs(round_id: int, local_epochs: int, batch_size: int, learning_rate: float,
                     deadline_seconds: float) -> None:
    """ValueError (one line) unless a task's own knobs are ones to train with: a round number that seeds a shuffle,
    at least one epoch and one example per batch, a finite learning rate > 0 (NaN, Inf or <= 0 trains garbage), a
    deadline that is a number of seconds (0 or less: no time left, which the deadline rule says)."""
    if round_id > MAX_TASK_ROUND:
        raise ValueError(f"the task's round must be at most {MAX_TASK_ROUND}, got {round_id}")
    if local_epochs < 1 or batch_size < 1:
        raise ValueError(f"the task asks for {local_epochs} local epochs in batches of {batch_size}: each must be >= 1")
    if not (learning_rate > 0 and math.isfinite(learning_rate)):
        raise ValueError(f"the task's learning rate must be a finite number > 0, got {learning_rate}")
    if not deadline_seconds <= MAX_TASK_SECONDS:  # NaN fails this too
        raise ValueError(f"the task's deadline must be at most {MAX_TASK_SECONDS:.0e} seconds, got {deadline_seconds}")


def check_compression(method: str, topk_ratio: float | None = None, int8_block: int | None = None) -> None:
    """Raise ValueError unless ``method`` is a known compression and the knobs given are in range."""
    if method not in COMPRESSION_METHODS:
        raise ValueError(f"compression method must be one of {', '.join(COMPRESSION_METHODS)}, got {method!r}")
    if topk_ratio is not None and not 0 < topk_ratio <= 1:
        raise ValueError(f"topk_ratio must be in (0, 1], got {topk_ratio}")
    if int8_block is not None and int8_block < 1:
        raise ValueError(f"int8_block must be >= 1, got {int8_block}")


@dataclass(frozen=True, eq=False)
class TaskSettings(Mapping):
    """What an agent must do differently in a task: compress, add a proximal term, clip/noise, mask its upload."""

    compression: str = "none"  # "none": the agent uploads its new weights; else the method of its delta
    topk_ratio: float | None = None  # compression "topk" only; None: CompressionConfig's default
    int8_block: int | None = None  # compression "int8" only; None: CompressionConfig's default
    proximal_mu: float | None = None  # FedProx: weight of the proximal term (>= 0)
    dp_clip_norm: float | None = None  # client-side DP: L2 bound on new - global (> 0)
    dp_local_noise: float | None = None  # client-side DP: local noise multiplier (>= 0), with dp_clip_norm only
    secure_aggregation: bool = False  # SecAgg+: the agent uploads a masked vector and nothing in the clear
    # A Flower strategy's configure_fit config (aggregation/flower_strategy.py): str keys, bool/int/float/str
    # values, passed to the fit() of Flower clients run by fedpar (client/flower_client.py); other trainers ignore it.
    fit_config: dict | None = None
    # A Message-API Flower strategy's configure_evaluate config (aggregation/flower_message_strategy.py), same rules,
    # passed to the evaluate handler of the ClientApp (or a Flower client's evaluate) run by fedpar.
    eval_config: dict | None = None
    # A Flower App run (--flower-app on the coordinator): the run's config, the app's [tool.flwr.app.config] with the
    # coordinator's --run-config, same rules; the ClientApp's Context.run_config holds it (a SuperNode's ClientApp
    # sees the run's config, not one of its own).
    run_config: dict | None = None
    # Federated evaluation: the agent scores the received global model on its validation split before training
    # (off in the rounds --client-eval-every skips).
    evaluate: bool = True

    def __post_init__(self) -> None:
        """Check types (numbers become floats) and ranges; raise ValueError naming the setting."""
        if not isinstance(self.compression, str):
            raise ValueError(f"compression must be a string, got {self.compression!r}")
        for flag in ("secure_aggregation", "evaluate"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.int8_block is not None and (isinstance(self.int8_block, bool) or not isinstance(self.int8_block, int)):
            raise ValueError(f"int8_block must be a whole number, got {self.int8_block!r}")
        for name in ("topk_ratio", "proximal_mu", "dp_clip_norm", "dp_local_noise"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{name} must be a number, got {value!r}")
                object.__setattr__(self, name, float(value))
        check_compression(self.compression, self.topk_ratio, self.int8_block)
        for name in ("fit_config", "eval_config", "run_config"):
            if getattr(self, name) is not None:
                _check_fit_config(getattr(self, name), name)
                object.__setattr__(self, name, dict(getattr(self, name)))  # not the caller's dict
        for knob, method in (("topk_ratio", "topk"), ("int8_block", "int8")):
            if getattr(self, knob) is not None and self.compression != method:
                raise ValueError(f"{knob} goes with compression {method!r}, not {self.compression!r}")
        if self.proximal_mu is not None and not (self.proximal_mu >= 0 and math.isfinite(self.proximal_mu)):
            raise ValueError(f"proximal_mu must be >= 0, got {self.proximal_mu}")
        clip, noise = self.dp_clip_norm, self.dp_local_noise
        if noise is not None and clip is None:
            raise ValueError("dp_local_noise needs dp_clip_norm (local noise is scaled by the clip norm)")
        if clip is not None and not (clip > 0 and math.isfinite(clip) and (noise is None or
                                                                         (noise >= 0 and math.isfinite(noise)))):
            raise ValueError(f"client-side DP needs dp_clip_norm > 0 and dp_local_noise >= 0, got dp_clip_norm={clip}"
                             + ("" if noise is None else f" and dp_local_noise={noise}"))
        if self.secure_aggregation and (self.compression != "none" or (noise or 0) > 0):
            raise ValueError("secure_aggregation masks the update itself: it goes with neither compression "
                             "nor client-side DP's local noise (the coordinator cannot clip a noisy masked update)")

    # ------------------------------------------------------------------ the wire form
    def to_json(self) -> str:
        """The extra_json of a task with these settings (unset fields left out)."""
        return json.dumps(dict(self))

    @classmethod
    def from_json(cls, text: str) -> TaskSettings:
        """Parse a task's extra_json; ValueError (one line) for bad JSON, unknown keys, wrong types or ranges."""
        return _parsed(cls, text)

    @classmethod
    def _from_json(cls, text: str) -> TaskSettings:
        if len(text) > MAX_JSON_CHARS:
            raise ValueError(f"the task's settings are longer than {MAX_JSON_CHARS} characters")
        try:
            parsed = json.loads(text or "{}")
        except ValueError as exc:
            raise ValueError(f"the task's settings are not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"the task's settings must be a JSON object, got {type(parsed).__name__}")
        return cls.of(parsed)

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> TaskSettings:
        """``settings`` as a TaskSettings (a mapping of wire keys is checked like a task's JSON)."""
        if isinstance(settings, TaskSettings):
            return settings
        unknown = sorted(set(settings) - set(_FIELDS))
        if unknown:
            raise ValueError(f"the task asks for settings this agent cannot do: "
                             f"unknown {', '.join(map(repr, unknown))} "
                             f"(it knows {', '.join(_FIELDS)}); update the agent or the coordinator")
        try:
            return cls(**settings)
        except ValueError as exc:
            raise ValueError(f"the task asks for settings this agent cannot do: {exc}") from None

    # ------------------------------------------------------------------ read as the mapping it travels as
    def __getitem__(self, key: str) -> Any:
        """The value of a set field (KeyError for one left at its default)."""
        if key not in _FIELDS or getattr(self, key) == _FIELDS[key]:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        """The names of the set fields, in declaration order."""
        return (name for name, default in _FIELDS.items() if getattr(self, name) != default)

    def __len__(self) -> int:
        """How many fields are set."""
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        """Only the set fields."""
        return f"TaskSettings({', '.join(f'{k}={v!r}' for k, v in self.items())})"


def _check_fit_config(config: Any, name: str = "fit_config") -> None:
    """ValueError unless ``config`` is a JSON object of short names to bool, int, finite float or str values."""
    if not isinstance(config, dict):
        raise ValueError(f"{name} must be an object of names to values, got {type(config).__name__}")
    for key, value in config.items():
        if not isinstance(key, str) or not 0 < len(key) <= 128:
            raise ValueError(f"{name} names must be strings of 1..128 characters, got {key!r}")
        if not isinstance(value, (bool, int, float, str)) or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"{name} {key!r} must be a bool, int, finite float or str, got {value!r}")


_FIELDS = {f.name: f.default for f in fields(TaskSettings)}


@functools.lru_cache(maxsize=16)
def _parsed(cls: type[TaskSettings], text: str) -> TaskSettings:
    """:meth:`TaskSettings._from_json`, once per text: a round's tasks all carry the same settings, and a simulation
    host reads them for every member (a TaskSettings is frozen; a ValueError is not cached)."""
    return cls._from_json(text)
