"""The --compression/--topk-ratio/--int8-block options shared by `fedpar serve` and `fedpar simulate`, declared
with CompressionConfig (protocol/compressed_wire.py)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from fedpar.cli.declared import add_declared, from_args
from fedpar.protocol.compressed_wire import CompressionConfig


def add_compression_arguments(p: argparse.ArgumentParser) -> None:
    """Add the update-compression options to ``p``."""
    add_declared(p, CompressionConfig)


def compression_from_args(args: argparse.Namespace) -> CompressionConfig:
    """The CompressionConfig the options ask for; ValueError with a readable message when they are invalid, or set
    a knob of a method not chosen (a user who set it believes that method runs)."""
    config = from_args(CompressionConfig, args)
    for knob, method in (("topk_ratio", "topk"), ("int8_block", "int8")):
        default = next(f.default for f in fields(CompressionConfig) if f.name == knob)
        if config.method != method and getattr(config, knob) != default:
            raise ValueError(f"--{knob.replace('_', '-')} applies only with --compression {method}; add it (or drop "
                             "the option)")
    return config
