"""The --compression/--topk-ratio/--int8-block options shared by `fedpar serve` and `fedpar simulate`."""

from __future__ import annotations

import argparse

from fedpar.cli.argtypes import count, fraction
from fedpar.protocol.compressed_wire import CompressionConfig
from fedpar.protocol.task_settings import COMPRESSION_METHODS as METHODS

COMPRESSION_HELP = (
    "how agents compress the update they upload (the coordinator tells them; agents need no flag). "
    "none: the new float32 weights, exact. "
    "fp16: the delta (new - global) as float16, 2 bytes/parameter, error <= 2^-11 |x| + 2^-25 per element "
    "(deltas beyond +-65504 are not sent: use bf16). "
    "bf16: the delta as bfloat16, 2 bytes/parameter, error <= 2^-8 |x|. "
    "int8: the delta stochastically rounded to int8 with one float32 scale per --int8-block values, "
    "about 1 byte/parameter, error <= max|x in its block| / 127 and unbiased. "
    "topk: only the ceil(ratio x n) largest-magnitude delta entries of each tensor (int32 index + float32 value, "
    "8 bytes each); the rest stays on the agent and is added to its next delta (error feedback): "
    "delayed, never lost")


def add_compression_arguments(p: argparse.ArgumentParser) -> None:
    """Add the update-compression options to ``p``."""
    d = CompressionConfig()
    p.add_argument("--compression", choices=METHODS, default=d.method, help=COMPRESSION_HELP)
    p.add_argument("--topk-ratio", type=fraction, default=d.topk_ratio,
                   help="with --compression topk: share of each tensor's entries sent, in (0, 1]; "
                        "0.01 sends 1/50 of the float32 bytes")
    p.add_argument("--int8-block", type=count, default=d.int8_block,
                   help="with --compression int8: values sharing one float32 scale (smaller: more accurate, "
                        "4 more bytes per block)")


def compression_from_args(args: argparse.Namespace) -> CompressionConfig:
    """The CompressionConfig the options ask for; ValueError with a readable message when they are invalid."""
    return CompressionConfig(method=args.compression, topk_ratio=args.topk_ratio, int8_block=args.int8_block)
