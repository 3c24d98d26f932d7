"""The --compression/--topk-ratio/--int8-block options shared by `fedpar serve` and `fedpar simulate`, declared
with CompressionConfig (protocol/compressed_wire.py)."""

from __future__ import annotations

import argparse

from fedpar.cli.config import refuse_unswitched
from fedpar.cli.declared import add_declared, from_args, switched_settings
from fedpar.protocol.compressed_wire import CompressionConfig


def add_compression_arguments(p: argparse.ArgumentParser) -> None:
    """Add the update-compression options to ``p``."""
    add_declared(p, CompressionConfig)


def compression_from_args(args: argparse.Namespace) -> CompressionConfig:
    """The CompressionConfig the options ask for; ValueError with a readable message when they are invalid, or set
    a knob of a method not chosen (a user who set it believes that method runs)."""
    refuse_unswitched(args, switched_settings(CompressionConfig))  # for a service's run; main refused a command's
    return from_args(CompressionConfig, args)
