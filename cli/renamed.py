"""Options that were renamed: the old flag (or TOML key) is refused with one line naming the new ones."""

from __future__ import annotations

import argparse


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
