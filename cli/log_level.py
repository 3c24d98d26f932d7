"""``--log-level`` of every subcommand: the level of fedpar's loggers, and gRPC's own verbosity (errors only;
all at debug)."""

from __future__ import annotations

import argparse
import logging
import os

from fedpar.parallel.child_logs import FORMAT, quiet_libraries

LEVELS = ("debug", "info", "warning", "error")


def add_log_level_argument(p: argparse.ArgumentParser, default: str | None) -> None:
    """Add ``--log-level`` (``default``: the command's level when it is not given; None: Python's own)."""
    p.add_argument("--log-level", choices=LEVELS, default=default,
                   help="level of fedpar's log lines (and of gRPC's, at debug)")


def set_grpc_verbosity(argv: list[str]) -> None:
    """gRPC's and torch's C++ log lines: all of them when ``argv`` says --log-level debug, else (gRPC's) errors only
    and (torch's) none; set before either starts, as each reads it once. What the user set wins."""
    # Unset, gRPC's C core logs at INFO through absl: "Handshake failed ..." for every agent whose TLS setting
    # differs from the coordinator's, on both sides, which fedpar's own lines already explain.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    known, _ = pre.parse_known_args(argv)
    os.environ.setdefault("GRPC_VERBOSITY", "DEBUG" if known.log_level == "debug" else "ERROR")
    # The same for torch's C++ log (read once, when torch is imported; rank processes inherit it): a lost rank
    # makes gloo log "Rank 1 failed to pass monitoredBarrier" on the others, beside fedpar's own line naming it.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "INFO" if known.log_level == "debug" else "FATAL")


def setup_logging(args: argparse.Namespace | dict, fallback: str = "info") -> None:
    """Log at ``args.log_level`` (``fallback`` where args have none, e.g. a rank spawned with plain options)."""
    level = (args.get("log_level") if isinstance(args, dict) else getattr(args, "log_level", None)) or fallback
    logging.basicConfig(level=level.upper(), format=FORMAT)
    logging.getLogger("fedpar").setLevel(level.upper())
    quiet_libraries(logging.getLevelName(level.upper()))
