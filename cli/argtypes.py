"""Range-checked argparse types for numeric options, and the parser that reports a bad option in one line.

Every subcommand declares its numeric options with these, so ``--port 99999`` or ``--drop-probability 1.5``
is refused at parse time with the option's name and the range it takes.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from pathlib import Path
from typing import Callable


class FedparParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the command, the problem and where help is. It takes no
    abbreviated option (``--insecur`` would start a plaintext coordinator, and a new option could change what an
    abbreviation means); a mistyped one is named with the option it looks like."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def format_help(self) -> str:
        """The help text; an option's ``help_factory`` (help that needs heavy imports) is called only now."""
        for action in self._actions:
            factory = getattr(action, "help_factory", None)
            if factory is not None:
                action.help, action.help_factory = factory(), None
        return super().format_help()

    def error(self, message: str):
        """Print ``prog: error: message`` and exit 2 (argparse would print the whole usage first)."""
        print(f"{self.prog}: error: {message}; see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(2)

    def unrecognized(self, extra: list[str]):
        """:meth:`error` for arguments this command does not take, naming the option each one looks like."""
        options = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        meant = [close[0] for arg in extra if arg.startswith("--")
                 if (close := difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.75))]
        self.error(f"unrecognized arguments: {' '.join(extra)}"
                   + (f" (did you mean {', '.join(dict.fromkeys(meant))}?)" if meant else ""))


def _number(kind: type, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def ranged(kind: type, low=None, high=None, what: str = "") -> Callable[[str], int | float]:
    """An argparse type: ``kind(text)`` within [low, high] (None: unbounded), else an error naming the range."""
    def parse(text: str):
        value = _number(kind, text)
        if (low is not None and value < low) or (high is not None and value > high):
            if high is None:
                bound = f"at least {low}"
            elif low is None:
                bound = f"at most {high}"
            else:
                bound = f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what or 'it'} must be {bound}")
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


def positive(text: str) -> float:
    """An argparse type: a number greater than 0 (seconds, rates, learning rates, clip norms)."""
    value = _number(float, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is out of range: it must be greater than 0")
    return value


positive.kind = float


MAX_SECONDS = 1e9  # about 31 years: above it a timeout overflows threading's waits and datetime.timedelta


def seconds(text: str) -> float:
    """An argparse type: a duration or timeout in seconds, in (0, 1e9] (--deadline 1e30 passed; a gloo timeout of
    1e30 ended in an OverflowError traceback)."""
    value = _number(float, text)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} is out of range: seconds must be greater than 0 and at most "
                                         f"{MAX_SECONDS:.0e}")
    return value


seconds.kind = float


def fraction(text: str) -> float:
    """An argparse type: a share in (0, 1] (--fraction, --topk-ratio)."""
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is out of range: it must be in (0, 1]")
    return value


fraction.kind = float


def held_out(text: str) -> float:
    """An argparse type: a share held out in [0, 1) (--val-fraction: the rest must train)."""
    value = _number(float, text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is out of range: it must be in [0, 1) (some examples must train)")
    return value


held_out.kind = float


def open_unit(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1 (--privacy-delta, --privacy-adaptive-quantile)."""
    value = _number(float, text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text} is out of range: it must be in (0, 1)")
    return value


open_unit.kind = float


def below_one(text: str) -> float:
    """An argparse type: a factor in [0, 1) (--momentum: at 1 or above the steps never decay and training diverges)."""
    value = _number(float, text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is out of range: it must be in [0, 1)")
    return value


below_one.kind = float


def address(text: str) -> str:
    """An argparse type: a coordinator's HOST:PORT (``[::1]:PORT`` for IPv6; a gRPC target with a scheme, e.g.
    ``dns:///host:port`` or ``unix:PATH``, as it is)."""
    text = text.strip()
    if "://" in text or text.startswith(("unix:", "unix-abstract:")):
        return text
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or host.startswith("[") != host.endswith("]"):
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be a number in 1..65535 (e.g. 127.0.0.1:50051)")
    return text


address.kind = str


def text(value: str) -> str:
    """An argparse type: a word that is not empty (``--task "$TASK"`` with TASK unset ran without a task, silently)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty value: give one, or leave the option out")
    return value


text.kind = str


def path(text: str) -> Path:
    """An argparse type: a path, not empty (an empty one would be the current folder: a slip, never meant)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: give a file's or a folder's path")
    return Path(text)


path.kind = Path


def folder(text: str) -> str:
    """An argparse type: the path of a folder a command writes into (--out), not empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: give a folder, e.g. runs/first (created if missing)")
    return text


folder.kind = str


def host(text: str) -> str:
    """An argparse type: an address to listen on, a host name or an IP address (not empty: gRPC refuses ':PORT')."""
    text = text.strip()
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a host name or an IP address (e.g. 127.0.0.1, or 0.0.0.0 "
                                         "for every interface)")
    return text


host.kind = str


def file_to_write(text: str):
    """An argparse type: the path of a file this command writes (--port-file): not empty, not a folder, in a
    folder that exists (a port file that cannot be written would be said only once the port is open)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: give the path of a file to write, e.g. run/port")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give the path of a file to write, e.g. "
                                         f"{path / 'port'}")
    folder = path.parent
    if not folder.is_dir():
        state = "is a file, not a folder" if folder.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text}: its folder {folder} {state}; create the folder or pick another "
                                         "path")
    return path


file_to_write.kind = Path


def id_list(text: str) -> list[str]:
    """An argparse type: comma-separated ids (``alice,bob``), each stripped, empty ones dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


id_list.splits = True  # a repeated flag extends one list (cli/declared.py)


class KeyValueOption(argparse.Action):
    """Collect ``KEY=VALUE`` into a dict on top of the config file's table; a later flag overrides a key."""

    def __call__(self, parser, namespace, value, option_string=None):
        """Add one ``KEY=VALUE``."""
        key, sep, text = value.partition("=")
        if not sep or not key.strip():
            parser.error(f"{option_string} expects KEY=VALUE, got {value!r}")
        try:
            options = as_mapping(getattr(namespace, self.dest, None), self.dest)
        except ValueError as exc:
            parser.error(str(exc))
        options[key.strip()] = text.strip()
        setattr(namespace, self.dest, options)


def as_mapping(value, name: str = "strategy_options") -> dict:
    """The options (``name`` in a config file) as a dict, from a flag-built dict, a TOML table, or a TOML list of
    ``"KEY=VALUE"`` strings."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value):
        return {k.strip(): v.strip() for k, _, v in (item.partition("=") for item in value)}
    raise ValueError(f"{name} must be a table or a list of \"KEY=VALUE\" strings, got {value!r}")
