"""The --compression/--topk-ratio/--int8-block options shared by `fedpar serve` and `fedpar simulate`, declared
with CompressionConfig (protocol/compressed_wire.py)."""

from __future__ import annotations

import argparse

from fedpar.cli.declared import add_declared, from_args
from fedpar.protocol.compressed_wire import CompressionConfig


def add_compression_arguments(p: argparse.ArgumentParser) -> None:
    """Add the update-compression options to ``p``."""
    add_declared(p, CompressionConfig)


def compression_from_args(args: argparse.Namespace) -> CompressionConfig:
    """The CompressionConfig the options ask for; ValueError with a readable message when they are invalid."""
    return from_args(CompressionConfig, args)
