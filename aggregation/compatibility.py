"""The features that cannot run together, and why: the one table of them (docs/explanation/composition.md shows it).

Every other pair of features composes (tests/test_composition.py runs a pairwise cover of them). What is left here
is impossible on mathematical grounds: secure aggregation shows the coordinator only a sum, differential privacy
releases only a noisy sum, and a masked vector is uniformly random. Each refusal is one line saying why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from fedpar.aggregation.catalog import strategy_classes
from fedpar.aggregation.strategy import FLOWER_PREFIX

DP_PREFIX = "dp-"
FLOWER_LINEAR = "flower:FedAvg, flower:FedAvgM, flower:FedProx, flower:FedAdam, flower:FedAdagrad or flower:FedYogi"
CLIENT_WITH_NOISE = "client with --privacy-local-noise"  # a privacy level: the server re-clips each noisy update
# What each feature of the table is called in its lines and in the docs (a strategy's feature names it instead;
# "robust" is followed by the names robust_strategies() gives).
FEATURES = {
    "secure_aggregation": "--secure-aggregation",
    "privacy": "--privacy",
    "server_clip": "--privacy central (or client with --privacy-local-noise)",
    "compression": "--compression",
    "max_agent_share": "--max-agent-share",
    "robust": "a robust strategy",
    "flower": "a Flower strategy other than FedAvg, FedAvgM, FedProx and the FedOpt family (flower:...)",
}


def robust_strategies() -> tuple[str, ...]:
    """The registered strategies that are not linear (a median, Krum, ...): their rule needs every update of a round
    itself, so it cannot run on a sum (secure aggregation) or a noisy sum (DP)."""
    return tuple(name for name, cls in strategy_classes().items() if not cls.linear)


def linear_strategy_names() -> list[str]:
    """The strategies whose new model depends on the updates only through their weighted mean (``linear``): those
    secure aggregation and aggregator ranks can run."""
    return [name for name, cls in strategy_classes().items() if cls.linear]


def linear_flower(name: str) -> bool:
    """Whether ``flower:REF`` names one of Flower's strategies that step from the results' weighted mean alone
    (aggregation/flower_strategy.py LINEAR_CLASSES): they take a masked or noisy sum as one result. False when it
    names no Flower strategy (building it says why) or Flower is not installed."""
    try:
        from fedpar.aggregation.flower_message_strategy import flower_class  # imports Flower: only for flower: names
        from fedpar.aggregation.flower_strategy import linear_flower_class
        return linear_flower_class(flower_class(name))
    except (ImportError, ValueError):
        return False


def feature_name(feature: str) -> str:
    """How the table's lines and docs/explanation/composition.md name ``feature``."""
    if feature == "robust":
        return f"{FEATURES[feature]} ({', '.join(robust_strategies())})"
    return FEATURES[feature]


@dataclass(frozen=True)
class Clash:
    """Two features that cannot run together, and the mathematical reason."""

    first: str
    second: str
    reason: str
    linear_instead: bool = False  # a linear strategy runs with the first feature: the line lists them

    def line(self, named: Mapping[str, str] | None = None) -> str:
        """The one-line refusal, each feature as ``named`` calls it (else as :func:`feature_name` does)."""
        named = named or {}
        a, b = (named[f] if f in named else feature_name(f) for f in (self.first, self.second))
        instead = f"; use a linear strategy: {', '.join(linear_strategy_names())}" if self.linear_instead else ""
        if self.linear_instead and self.second == "flower":
            instead += f", or Flower's {FLOWER_LINEAR}"
        return f"{a} cannot run with {b}: {self.reason}{instead}"


CLASHES = (
    Clash("secure_aggregation", "robust",
          "the coordinator only sees the sum of the masked updates, and a median, a trimmed mean or Krum's choice "
          "needs each update", linear_instead=True),
    Clash("secure_aggregation", "flower",
          "the coordinator only sees the sum of the masked updates, and such a strategy's aggregation (aggregate_fit, "
          "aggregate_train) needs each agent's result", linear_instead=True),
    Clash("secure_aggregation", "server_clip",
          "the coordinator would clip each update to --privacy-clip (central DP), or clip each noisy update back to "
          "it (local noise: the accountant bounds a client's whole contribution), and a masked update cannot be "
          "clipped; use --privacy client without local noise: the agents clip, the coordinator noises the sum"),
    Clash("secure_aggregation", "compression",
          "a masked update is uniformly random in its finite field, so no encoding makes it smaller (secure "
          "aggregation quantizes each update to --secagg-clip's grid already)"),
    Clash("secure_aggregation", "max_agent_share",
          "the coordinator never sees an update's weight, only the sum of the masked ones; bound the weights with "
          "--secagg-max-weight instead"),
    Clash("privacy", "robust",
          "DP-FedAvg releases only the noisy sum of the clipped updates (its noise is sized to that sum's "
          "sensitivity), and a median, a trimmed mean or Krum's choice needs each update", linear_instead=True),
    Clash("privacy", "flower",
          "DP-FedAvg releases only the noisy sum of the clipped updates (its noise is sized to that sum's "
          "sensitivity), and such a strategy's aggregation (aggregate_fit, aggregate_train) needs each agent's "
          "result", linear_instead=True),
)


def strategy_features(strategy: str) -> dict[str, str]:
    """The table's features a ``--strategy`` value brings (``dp-NAME``: DP-FedAvg around NAME), each with how a
    refusal names it."""
    name = strategy.strip()
    out: dict[str, str] = {}
    if name.lower().replace("_", "-").startswith(DP_PREFIX):
        out["privacy"] = FEATURES["privacy"]
        name = name[len(DP_PREFIX):]
    if name.lower().startswith(FLOWER_PREFIX) and not linear_flower(name):
        out["flower"] = f"--strategy {name}"
    elif name and name.lower().replace("-", "_") in robust_strategies():
        out["robust"] = f"--strategy {name}"
    return out


def clash(features: Mapping[str, str]) -> Clash | None:
    """The first clash among ``features`` (each feature that is on, with how a refusal names it), if any."""
    for c in CLASHES:
        if c.first in features and c.second in features:
            return c
    return None


def refusal(features: Mapping[str, str]) -> str | None:
    """The one-line refusal of the first clash among ``features``, or None when they compose."""
    c = clash(features)
    return c.line(features) if c is not None else None


def privacy_level(mode: str, local_noise: float = 0.0) -> str:
    """How the table tells DP modes apart: 'off', 'central', 'client' or :data:`CLIENT_WITH_NOISE`."""
    return CLIENT_WITH_NOISE if mode == "client" and local_noise > 0 else mode


def options_privacy(options: Mapping[str, object]) -> str:
    """The :func:`privacy_level` of a DP strategy's options (``mode``, ``local_noise_multiplier``; 'off' without)."""
    return privacy_level(str(options.get("mode", "off")), float(options.get("local_noise_multiplier") or 0.0))


def composition_features(strategy: str, secure_aggregation: bool = False, compression: str = "none",
                         max_agent_share: float | None = None, privacy: str = "off") -> dict[str, str]:
    """The table's features a run's settings turn on, each named as a refusal names it (``privacy``: its
    :func:`privacy_level`; a ``dp-`` strategy with none given counts as central DP)."""
    on = strategy_features(strategy)
    if privacy != "off":
        on["privacy"] = FEATURES["privacy"]
    if "privacy" in on and privacy in ("off", "central", CLIENT_WITH_NOISE):  # a dp- name alone: central, its default
        on["server_clip"] = f"--privacy {privacy}" if privacy != "off" else FEATURES["privacy"]
    if secure_aggregation:
        on["secure_aggregation"] = FEATURES["secure_aggregation"]
    if compression != "none":
        on["compression"] = f"--compression {compression}"
    if max_agent_share is not None:
        on["max_agent_share"] = FEATURES["max_agent_share"]
    return on


def check_composition(strategy: str, secure_aggregation: bool = False, compression: str = "none",
                      max_agent_share: float | None = None, privacy: str = "off") -> None:
    """ValueError with the table's line when the settings ask for two features that cannot run together."""
    line = refusal(composition_features(strategy, secure_aggregation, compression, max_agent_share, privacy))
    if line is not None:
        raise ValueError(line)


def markdown_table(clashes: Iterable[Clash] = CLASHES) -> str:
    """The table as docs/explanation/composition.md shows it."""
    rows = ["| Feature | Cannot run with | Why |", "| --- | --- | --- |"]
    rows += [f"| {feature_name(c.first)} | {feature_name(c.second)} | {c.reason} |" for c in clashes]
    return "\n".join(rows)
