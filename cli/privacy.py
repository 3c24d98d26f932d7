"""Differential-privacy options shared by ``fedpar serve`` and ``fedpar simulate`` (``--privacy``, ``--privacy-*``)."""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass
from typing import Any

from fedpar.cli.config import chose, refuse_unswitched
from fedpar.cli.declared import add_declared, from_args, switched_settings
from fedpar.cli.renamed import add_renamed
from fedpar.settings import flag_of, setting

log = logging.getLogger("fedpar.privacy")

# Extra per-round table columns when differential privacy is on.
PRIVACY_COLUMNS = [("dp_epsilon", "{:>10.3f}"), ("dp_clip_norm", "{:>12.4f}")]

MODES = ("off", "central", "client")


@dataclass
class PrivacyOptions:
    """DP-FedAvg as the command line asks for it."""

    privacy: str = setting("off", choices=MODES, group="privacy", help=(
        "central: the coordinator clips every update's delta to --privacy-clip and adds Gaussian noise to the sum; "
        "client: agents clip their own update before uploading (the coordinator verifies the bound, refuses "
        "violators, and adds the noise). Updates are weighted uniformly, not by example count, so one client's "
        "influence stays bounded"))
    privacy_noise: float = setting(1.0, check="positive", group="privacy",
                                   help="noise multiplier z: the noise on the sum of clipped deltas has std z x clip "
                                        "norm")
    privacy_clip: float = setting(1.0, check="positive", group="privacy",
                                  help="L2 clip norm C of each update's change to the global model (initial C if "
                                       "adaptive)")
    privacy_adaptive_quantile: float | None = setting(
        None, check="open_unit", group="privacy",
        help="turn on adaptive clipping: move C each round toward this quantile of the update norms (e.g. 0.5), "
             "using a noisy count of unclipped updates")
    privacy_clip_lr: float = setting(0.2, check="positive", group="privacy",
                                     help="adaptive clipping: geometric step size of C")
    privacy_count_noise: float | None = setting(
        None, check="positive", group="privacy",
        help="adaptive clipping: std of the noise on the unclipped count (default clients-per-round/20, at least "
             "--privacy-noise; must exceed --privacy-noise / 2)")
    privacy_delta: float = setting(1e-5, check="open_unit", group="privacy",
                                   help="delta at which epsilon is reported each round; pick it below 1 / population")
    privacy_local_noise: float = setting(
        0.0, check="non_negative", group="privacy",
        help="with --privacy client: agents also add N(0, (s x C)^2) to every coordinate (local DP); the coordinator "
             "clips each noisy update back to C (the accountant's bound), which shrinks the signal by "
             "~1/(s sqrt(parameters)) once that noise dominates")
    privacy_population: int | None = setting(
        None, check="count", group="privacy",
        help="number of agents that may be sampled (needed with --privacy: it sets the sampling rate q = agents "
             "sampled per round / population used by the privacy accountant)")


# The DP strategy's options that --privacy's flags set (privacy_strategy), each to its PrivacyOptions field; the
# others it is given come from --clients, --clients-per-round and --overselect.
DP_OPTION_FIELDS = {"noise_multiplier": "privacy_noise", "clip_norm": "privacy_clip", "delta": "privacy_delta",
                    "mode": "privacy", "target_quantile": "privacy_adaptive_quantile",
                    "clip_learning_rate": "privacy_clip_lr", "count_noise": "privacy_count_noise",
                    "local_noise_multiplier": "privacy_local_noise"}
DP_DERIVED_OPTIONS = ("population", "clients_per_round", "sampled_per_round")

_OLD_SUFFIXES = ("noise", "clip", "adaptive-quantile", "clip-lr", "count-noise", "delta", "local-noise", "population")


def add_privacy_arguments(p: argparse.ArgumentParser, population_flag: bool) -> None:
    """The ``--privacy*`` options; ``population_flag`` adds ``--privacy-population`` (serve: the coordinator cannot
    know it). The old ``--dp*`` names are refused with a line naming the new ones."""
    add_declared(p, PrivacyOptions, skip=() if population_flag else ("privacy_population",))
    add_renamed(p, "--dp", "is gone: differential privacy is --privacy {off,central,client} (DDP replicas, on "
                           "client and train, are --dp-replicate)",
                "is gone: differential privacy is privacy = \"off\" | \"central\" | \"client\" (DDP replicas, "
                "for client and train, are dp_replicate)")
    for suffix in _OLD_SUFFIXES:
        if suffix != "population" or population_flag:
            add_renamed(p, f"--dp-{suffix}", f"is now --privacy-{suffix}",
                        f"is now privacy_{suffix.replace('-', '_')}")


def privacy_on(args: argparse.Namespace) -> bool:
    """Whether the parsed options ask for differential privacy."""
    return getattr(args, "privacy", "off") != "off"


def privacy_strategy(args: argparse.Namespace, strategy: str, clients_per_round: int, overselect: float,
                     population: int | None) -> tuple[str, dict[str, Any]]:
    """The strategy name and DP options for the parsed flags (unchanged name and no options when privacy is off)."""
    refuse_unswitched(args, switched_settings(PrivacyOptions))  # for a service's run; main refused a command's
    o = from_args(PrivacyOptions, args, privacy_population=population)
    if o.privacy == "off":
        return strategy, {}
    if population is None:
        raise ValueError(f"--privacy {o.privacy} needs --privacy-population: the number of agents that may be sampled")
    check_delta(args, o.privacy_delta, population)
    sampled = min(population, math.ceil(clients_per_round * overselect))
    options = {option: getattr(o, name) for option, name in DP_OPTION_FIELDS.items()}
    options.update(population=population, clients_per_round=clients_per_round, sampled_per_round=sampled)
    return f"dp-{strategy}", options


def check_delta(args: argparse.Namespace, delta: float, population: int) -> None:
    """ValueError for a --privacy-delta the user gave at or above 1 / population, where (epsilon, delta)-DP allows
    releasing a client's data outright; the default there is said once, as a warning."""
    if delta * population < 1:
        return
    line = (f"--privacy-delta {delta:g} is not below 1 / population (1/{population} = {1 / population:.3g}): at such "
            f"a delta the reported epsilon guarantees nothing")
    if chose(args, "privacy_delta"):
        raise ValueError(f"{line}; pick one below {1 / population:.3g}")
    if getattr(args, "launcher_pid", None) is not None:  # a launched simulation's child: its launcher said it
        return
    log.warning("%s; give --privacy-delta below %.3g", line.replace(f"--privacy-delta {delta:g}",
                                                                    f"the default --privacy-delta {delta:g}"),
                1 / population)


def split_privacy_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A DP strategy's ``options`` (the user's strategy options joined by :func:`privacy_strategy`'s) as the user
    gave them: (the --strategy-option ones, the --privacy ones by flag); the derived ones are left out."""
    own = {k: v for k, v in options.items() if k not in DP_OPTION_FIELDS and k not in DP_DERIVED_OPTIONS}
    flags = {flag_of(PrivacyOptions, DP_OPTION_FIELDS[k]): v for k, v in options.items() if k in DP_OPTION_FIELDS}
    return own, flags
