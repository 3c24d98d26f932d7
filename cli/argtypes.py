"""Range-checked argparse types for numeric options, and the parser that reports a bad option in one line.

Every subcommand declares its numeric options with these, so ``--port 99999`` or ``--drop-probability 1.5``
is refused at parse time with the option's name and the range it takes.
"""

from __future__ import annotations

import argparse
import re
import sys
import weakref
from pathlib import Path
from typing import Callable, Collection

from fedpar.meant import closest, did_you_mean
from fedpar.ranges import (  # noqa: F401  the declared ranges (fedpar/ranges.py), argparse types by their names
    MAX_SECONDS, at_least_one, below_one, cert_days, count, fraction, held_out, int8_block, local_processes,
    non_negative, non_negative_int, open_unit, port, positive, probability, ranged, secagg_weight, seconds, seed,
    step_delay, task_count, threads)
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
        message = _with_meant_choice(self._with_config_keys(message))
        print(f"{self.prog}: error: {message}; see '{self.prog} --help'", file=sys.stderr)
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

    def long_options(self) -> list[str]:
        """The --options this command takes, in the order declared."""
        return [s for action in self._actions for s in action.option_strings if s.startswith("--")]

    def unrecognized(self, extra: list[str], coordinators: Collection[str] = ()):
        """:meth:`error` for arguments this command does not take, naming the option each one looks like, or the one
        this command has for it under another name (:data:`ELSEWHERE_CALLED`); flags of ``coordinators`` (fedpar
        serve's, given to an agent) are said as the coordinator's, not as a misspelling of the agent's own."""
        flags = [arg.split("=", 1)[0] for arg in extra if arg.startswith("--")]
        theirs = [flag for flag in flags if flag in coordinators]
        if theirs:
            them = "it" if len(theirs) == 1 else "them"
            self.error(f"unrecognized arguments: {' '.join(extra)} ({', '.join(theirs)}: fedpar serve's, not an "
                       "agent's: the coordinator decides the rounds, the training settings and the outputs, and "
                       f"sends each agent what it needs with its tasks; leave {them} out here)")
        meant = did_you_mean(meant_option(flag, self.long_options()) for flag in flags)
        self.error(f"unrecognized arguments: {' '.join(extra)}{meant}")


# words typed as a command that are the parser's own flags (`fedpar help`, `fedpar version`)
FLAG_WORDS = {"help": "--help", "version": "--version"}
_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<word>[^']*)' \(choose from (?P<choices>.*)\)$")


def _with_meant_choice(message: str) -> str:
    """``message``, an invalid choice's followed by the choice it most likely misspells (argparse names none)."""
    found = _INVALID_CHOICE.search(message)
    if found is None:
        return message
    word = found["word"]
    choices = re.findall(r"'([^']*)'", found["choices"])
    flag = FLAG_WORDS.get(word.lower()) if message.startswith("argument COMMAND:") else None
    meant = did_you_mean([flag, closest(word, choices, cutoff=0.6)])
    return message[:found.end("word") + 1] + meant + message[found.end("word") + 1:]


# A setting that commands, or other tools, name differently: a flag this command lacks -> what it is called here,
# with a value where the other tool's flag is one value of ours (`simulate --iid`: did you mean --partition iid?).
# Said when a command lacks the flag and has the other (`train --data-dir`: --data-path; `simulate --epochs`:
# --local-epochs; Flower's --num-supernodes: --clients); a misspelling is found by closest() first.
ELSEWHERE_CALLED = {"--data-dir": ("--data-path",), "--data-path": ("--data-dir",), "--port": ("--server",),
                    "--host": ("--server",), "--epochs": ("--local-epochs",), "--local-epochs": ("--epochs",),
                    "--learning-rate": ("--lr",), "--num-supernodes": ("--clients",),
                    "--fraction-fit": ("--fraction", "--clients-per-round"), "--iid": ("--partition iid",),
                    "--non-iid": ("--partition dirichlet:0.5",), "--alpha": ("--partition dirichlet:ALPHA",),
                    "--dirichlet-alpha": ("--partition dirichlet:ALPHA",), "--gpu": ("--device cuda",),
                    "--cuda": ("--device cuda",), "--cpu": ("--device cpu",), "--log-dir": ("--tensorboard",),
                    "--logdir": ("--tensorboard",), "--verbose": ("--log-level debug",),
                    "--mu": ("--strategy-option proximal_mu=MU",),
                    "--proximal-mu": ("--strategy-option proximal_mu=MU",)}


def elsewhere_called(flag: str, options: Collection[str]) -> str | None:
    """What a command with ``options`` calls the setting another command or tool names ``flag`` (a flag, or a
    flag and value), else None."""
    return next((o for o in ELSEWHERE_CALLED.get(flag, ()) if o.split()[0] in options), None)


def meant_option(flag: str, options: list[str]) -> str | None:
    """The one of ``options`` that the unknown ``flag`` most likely means: one it misspells, else this command's name
    for a flag of another command; a double negative's unnegated flag (--no-no-central-eval: --central-eval, not
    the closest spelling, --no-central-eval, which means the opposite)."""
    unnegated = "--" + flag.removeprefix("--no-no-")
    if flag.startswith("--no-no-") and unnegated in options:
        return unnegated
    return closest(flag, options) or elsewhere_called(flag, options)


secagg_clip = ranged(float, 0.0, MAX_CLIP, "a coordinate's clip", open_low=True,
                     why="(a coordinate of an update past that means training diverged, and the secure sum's grid "
                         "step grows with the clip: the metrics' secagg_error_bound shows its error)")


WEB_SCHEMES = ("http", "https", "grpc", "grpcs", "tcp")  # not gRPC name resolvers, though users write them


def address(text: str) -> str:
    """An argparse type: a coordinator's HOST:PORT (``[::1]:PORT`` for IPv6; a gRPC target with a scheme, e.g.
    ``dns:///host:port`` or ``unix:PATH``, as it is; a web URL's http:// or https:// is refused)."""
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() in WEB_SCHEMES:  # gRPC reads it as a host name that never resolves: retried for ever
        raise argparse.ArgumentTypeError(f"{text!r}: a gRPC address has no {scheme}://; give HOST:PORT, e.g. "
                                         f"{rest.rstrip('/') or '127.0.0.1:50051'} (TLS is set by --certs)")
    if sep or text.startswith(("unix:", "unix-abstract:")):
        return text
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or host.startswith("[") != host.endswith("]"):
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be a number in 1..65535 (e.g. 127.0.0.1:50051)")
    try:  # a part of 64+ characters, or an empty one (a..b): "encoding with 'idna' codec failed" (run: a traceback)
        host.strip("[]").encode("idna")
    except UnicodeError:
        raise argparse.ArgumentTypeError(f"{text!r}: {host!r} is not a host name: each of its dot-separated parts "
                                         "must have 1 to 63 characters") from None
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


def file_path(text: str) -> Path:
    """An argparse type: the path of a file this command writes (export --to), not empty and not ending in '/'
    (a folder's: Path drops the slash, and the file took the folder's name)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: give the path of a file to write, e.g. model.pt")
    if text.endswith("/"):
        raise argparse.ArgumentTypeError(f"{text} ends in '/', which names a folder; name the file to write, e.g. "
                                         f"{text}model.pt")
    return Path(text)


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
    """An argparse type: comma-separated ids (``alice,bob``), each stripped, empty ones dropped (none left: refused)."""
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if not ids:  # e.g. --agents "$AGENTS" unset: the command went on as if the option were not given
        raise argparse.ArgumentTypeError(f"{text!r} names no id; give one or more, e.g. alice,bob")
    return ids


id_list.splits = True  # a repeated flag extends one list (cli/declared.py)


class Switch(argparse.BooleanOptionalAction):
    """A true/false setting's flag and its opposite, ``--no-FLAG``, which turns a --config file's true off."""

    def __init__(self, *args, help=None, **kwargs):
        super().__init__(*args, help=help, **kwargs)
        # the help as declared: the formatter says the default, as for any option (argparse's own suffix said it twice
        # where the help does, and left '%(default)s' in the generated reference)
        self.help = help


class KeyValueOption(argparse.Action):
    """Collect ``KEY=VALUE`` into a dict on top of the config file's table: a flag overrides the file's key; a key the
    flags give twice with two values is refused (one of them would be dropped in silence)."""

    def __call__(self, parser, namespace, value, option_string=None):
        """Add one ``KEY=VALUE``."""
        key, sep, text = value.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key:
            parser.error(f"{option_string} expects KEY=VALUE, got {value!r}")
        try:
            options = as_mapping(getattr(namespace, self.dest, None), self.dest)
        except ValueError as exc:
            parser.error(str(exc))
        typed = self._typed(namespace)
        if typed.get(key, text) != text:
            parser.error(f"{option_string} {key} is given twice, as {key}={typed[key]} and as {key}={text}; give it "
                         "once, with the value you mean")
        typed[key] = options[key] = text
        setattr(namespace, self.dest, options)

    def _typed(self, namespace: argparse.Namespace) -> dict[str, str]:
        """The keys the flags gave so far in the parse that fills ``namespace`` (an action outlives one parse)."""
        if getattr(self, "_namespace", lambda: None)() is not namespace:
            self._namespace, self._keys = weakref.ref(namespace), {}
        return self._keys


def key_value_list(value) -> bool:
    """Whether ``value`` is a TOML list of ``"KEY=VALUE"`` strings (a KEY=VALUE option's flag, repeated)."""
    return isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value)


def as_mapping(value, name: str = "strategy_options") -> dict:
    """The options (``name`` in a config file) as a dict, from a flag-built dict, a TOML table, or a TOML list of
    ``"KEY=VALUE"`` strings."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if key_value_list(value):
        pairs: dict[str, str] = {}
        for key, _, text in (item.partition("=") for item in value):
            key, text = key.strip(), text.strip()
            if pairs.get(key, text) != text:
                raise ValueError(f"{name}: {key} is given twice, as {key}={pairs[key]} and as {key}={text}; give it "
                                 "once, with the value you mean")
            pairs[key] = text
        return pairs
    raise ValueError(f"{name} must be a table or a list of \"KEY=VALUE\" strings, got {value!r}")
