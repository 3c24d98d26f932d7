"""Options that were renamed: the old flag (or TOML key) is refused with one line naming the new ones, or (an
alias) still accepted, with one line naming the new one; and flags that were retired: accepted for one release
with a one-line note."""

from __future__ import annotations

import argparse
import sys


class RenamedOption(argparse.Action):
    """A hidden option whose use, on the command line or in a TOML file, is an error saying what it became."""

    def __init__(self, option_strings, dest, message: str, toml_message: str, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.message, self.toml_message = message, toml_message

    def __call__(self, parser, namespace, values, option_string=None):
        """Refuse the option in one line (exit code 2)."""
        parser.error(f"{option_string} {self.message}")


def add_renamed(parser: argparse.ArgumentParser, old_flag: str, message: str, toml_message: str) -> None:
    """Refuse ``old_flag`` with ``message`` and its TOML key with ``toml_message`` (e.g. 'is now --privacy-noise'
    and 'is now privacy_noise')."""
    parser.add_argument(old_flag, dest=old_flag.lstrip("-").replace("-", "_"), action=RenamedOption,
                        message=message, toml_message=toml_message)


def add_replicas_renamed(parser: argparse.ArgumentParser) -> None:
    """Refuse ``--dp`` where it meant DDP replicas (``fedpar client``, ``fedpar train``)."""
    add_renamed(parser, "--dp", "is now --dp-replicate (DDP replicas); differential privacy is --privacy, on serve "
                                "and simulate",
                "is now dp_replicate (DDP replicas); differential privacy is privacy, for serve and simulate")


class AliasOption(argparse.Action):
    """A hidden old name of an option that still works: it sets the option it became and says so in one line (on
    the command line, or as a key of a --config file: see cli/config.py)."""

    def __init__(self, option_strings, dest, new: argparse.Action, **kwargs):
        super().__init__(option_strings, new.dest, default=argparse.SUPPRESS, type=new.type, help=argparse.SUPPRESS,
                         metavar=new.metavar)
        self.new_flag = new.option_strings[0]
        self.old_key = option_strings[0].lstrip("-").replace("-", "_")

    def note(self, prog: str, old: str, new: str | None = None) -> None:
        """The one line saying that ``old`` is now ``new`` (default: this option's new flag)."""
        note_renamed(prog, old, new or self.new_flag)

    def __call__(self, parser, namespace, values, option_string=None):
        """Set the new option, and say its new name."""
        self.note(parser.prog, option_string)
        setattr(namespace, self.dest, values)


def note_renamed(prog: str, old: str, new: str) -> None:
    """The one line saying that ``old`` is now ``new`` and the old name still works."""
    print(f"{prog}: note: {old} is now {new}; the old name still works", file=sys.stderr)


def add_alias(parser: argparse.ArgumentParser, old_flag: str, new: argparse.Action) -> None:
    """Accept ``old_flag`` (and its TOML key) as the old name of option ``new``, with a one-line note."""
    parser.add_argument(old_flag, action=AliasOption, new=new)


def add_negated_key(new: argparse.Action, old_key: str) -> None:
    """Read a --config file's ``old_key`` (``no_central_eval = true``), the old name of a true/false setting once
    declared negatively, as option ``new`` (``central_eval``) given the opposite value, with a one-line note (see
    cli/config.py); the old flag (``--no-central-eval``) is ``new``'s own ``--no-`` form, with the same meaning."""
    new.negated_key = old_key


class RetiredFlag(argparse.Action):
    """A hidden flag that no longer changes anything (what it turned on is the default): its use, on the command
    line or in a TOML file, is one note on stderr, and the command goes on."""

    def __init__(self, option_strings, dest, note: str, toml_note: str, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.note, self.toml_note = note, toml_note

    def __call__(self, parser, namespace, values, option_string=None):
        """Say, in one line, that the flag is not needed any more."""
        print(f"{parser.prog}: note: {option_string} {self.note}", file=sys.stderr)

    def tell_toml(self) -> None:
        """Say it for the flag's TOML key."""
        print(self.toml_note, file=sys.stderr)


def add_retired(parser: argparse.ArgumentParser, flag: str, note: str) -> None:
    """Accept ``flag`` (and its TOML key) for one more release with the one-line ``note`` (e.g. 'is the default
    now; drop it')."""
    key = flag.lstrip("-").replace("-", "_")
    parser.add_argument(flag, dest=key, action=RetiredFlag, note=note, toml_note=f"{parser.prog}: note: {key} {note}")
