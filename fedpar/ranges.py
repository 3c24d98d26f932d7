"""The ranges a numeric setting may be declared to take (``setting(check=NAME)``): each NAME here is a parser of
text that refuses a value out of its range in one line naming the range. The command line uses them as argparse
types (cli/argtypes.py), and :func:`fedpar.settings.check_declared` checks a config built in Python against the
same ranges. This module depends on nothing: every room may use it."""

from __future__ import annotations

import argparse
import math
from typing import Callable


def _number(kind: type, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _shown(value) -> str:
    """A bound as a range message says it: 0 and 1e+09 for floats, every digit for integers."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def ranged(kind: type, low=None, high=None, what: str = "", *, open_low: bool = False, open_high: bool = False,
           why: str = "") -> Callable[[str], int | float]:
    """An argparse type: ``kind(text)`` within [low, high] (None: unbounded; ``open_low``/``open_high``: that bound
    itself refused), else an error naming the range (and ``why``, after it)."""
    def parse(text: str):
        value = _number(kind, text)
        below = low is not None and (value <= low if open_low else value < low)
        above = high is not None and (value >= high if open_high else value > high)
        if below or above:
            if low is not None and high is not None and (open_low or open_high):
                bound = f"in {'(' if open_low else '['}{_shown(low)}, {_shown(high)}{')' if open_high else ']'}"
            elif high is None:
                bound = f"{'greater than' if open_low else 'at least'} {_shown(low)}"
            elif low is None:
                bound = f"{'below' if open_high else 'at most'} {_shown(high)}"
            else:
                bound = f"in {_shown(low)}..{_shown(high)}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what or 'it'} must be {bound}"
                                             + (f" {why}" if why else ""))
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    parse.kind = kind  # what a TOML value must be (cli/config.py)
    return parse


port = ranged(int, 0, 65535, "a TCP port (0 picks a free one)")
count = ranged(int, 1, None, "a count")  # rounds, clients, workers, ranks, ...
non_negative_int = ranged(int, 0, None, "a non-negative integer")
secagg_weight = ranged(int, 1, (1 << 30) - 1, "an agent's weight (two of them must fit a 31-bit sum)")
int8_block = ranged(int, 1, 1 << 20, "values per int8 block")  # each tensor is padded to whole blocks
step_delay = ranged(float, 0.0, 86_400.0, "seconds a step waits")  # sleep() overflows at 1e30
threads = ranged(int, 1, 1024, "torch threads")  # 100000 crashed torch's first matmul; 10^12 overflowed
cert_days = ranged(int, 1, 36_500, "days a certificate is valid (100 years at most)")  # X.509 ends at year 9999
seed = ranged(int, 0, 2**32 - 1, "a seed")  # torch.manual_seed overflowed at 10^20 (seeds derived from it add on)
# processes one command starts on this machine (--nproc, --workers, --aggregator-ranks): 10^12 would fork until
# the machine runs out
local_processes = ranged(int, 1, 1024, "processes started on this machine")
task_count = ranged(int, 1, 2**32 - 1, "a count each task carries (32 bits)")  # --local-epochs, --batch-size
probability = ranged(float, 0.0, 1.0, "a probability or fraction")
non_negative = ranged(float, 0.0, None, "a non-negative number")
at_least_one = ranged(float, 1.0, None, "a factor")  # --overselect
positive = ranged(float, 0.0, None, open_low=True)  # seconds, rates, learning rates, clip norms
MAX_SECONDS = 1e9  # about 31 years: above it a timeout overflows threading's waits and datetime.timedelta
seconds = ranged(float, 0.0, MAX_SECONDS, "seconds", open_low=True)  # --deadline, every timeout
fraction = ranged(float, 0.0, 1.0, open_low=True)  # a share: --fraction, --topk-ratio
held_out = ranged(float, 0.0, 1.0, open_high=True, why="(some examples must train)")  # --val-fraction
open_unit = ranged(float, 0.0, 1.0, open_low=True, open_high=True)  # --privacy-delta, its adaptive quantile
below_one = ranged(float, 0.0, 1.0, open_high=True)  # --momentum: from 1 up the steps never decay and training diverges
