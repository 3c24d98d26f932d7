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

from fedpar.secagg.field import MAX_CLIP


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
        print(f"{self.prog}: error: {self._with_config_keys(message)}; see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(2)

    def _with_config_keys(self, message: str) -> str:
        """``message``, each flag of a "required" one followed by the --config key that could give it instead."""
        head = "the following arguments are required: "
        if not message.startswith(head) or "--config" not in self._option_string_actions:
            return message
        table = self.prog.split()[-1]  # a subcommand's options are read from its own table (cli/config.py)
        keys = {"/".join(a.option_strings): a.dest for a in self._actions if a.required and a.option_strings}
        return head + ", ".join(f"{name} (or {keys[name]} in a --config file's [{table}] table)" if name in keys
                                else name for name in message.removeprefix(head).split(", "))

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
secagg_clip = ranged(float, 0.0, MAX_CLIP, "a coordinate's clip", open_low=True,
                     why="(a coordinate of an update past that means training diverged, and the secure sum's grid "
                         "step grows with the clip: the metrics' secagg_error_bound shows its error)")
below_one = ranged(float, 0.0, 1.0, open_high=True)  # --momentum: from 1 up the steps never decay and training diverges


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


def not_empty(kind: type, message: str) -> Callable[[str], object]:
    """An argparse type: ``kind(text)`` of a text that is not empty or blank, else ``message``."""
    def parse(value: str):
        if not value.strip():
            raise argparse.ArgumentTypeError(message)
        return kind(value)
    parse.__name__ = kind.__name__
    parse.kind = kind
    return parse


# --task "$TASK" with TASK unset ran without a task, silently
text = not_empty(str, "an empty value: give one, or leave the option out")
path = not_empty(Path, "an empty path: give a file's or a folder's path")  # Path('') is the current folder
folder = not_empty(str, "an empty path: give a folder, e.g. runs/first (created if missing)")  # --out


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
