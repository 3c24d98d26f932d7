"""The ``fedpar`` command: dispatches to one module per subcommand."""

from __future__ import annotations

if __name__ == "__main__":  # python -m fedpar.cli.main: before this module's imports, as cli/entry.py does
    import sys

    from fedpar.cli.leaving import arrange

    arrange()  # before logging and the rest add exit handlers
    from fedpar.cli.log_level import set_grpc_verbosity

    set_grpc_verbosity(sys.argv[2:])  # before gRPC loads (fedpar.cli.config imports it): it reads GRPC_VERBOSITY once

import argparse
import importlib
import importlib.util
import os
import signal
import sys

from fedpar.cli.log_level import add_log_level_argument, set_grpc_verbosity, setup_logging
from fedpar.cli.argtypes import FedparParser, elsewhere_called, text
from fedpar.cli.config import ConfigError, apply_config_defaults, given_settings, refuse_unswitched
from fedpar.cli.declared import switched_options
from fedpar.cli.subcommands import SUBCOMMANDS
from fedpar.cli.user_errors import UserError, describe, quiet_exit_for_pipe, reader_left, runs_service
from fedpar.parallel.stopping import dump_stacks_on_signal, exit_code, signal_name
from fedpar.task import TaskError

DESCRIPTION = ("federated learning, and its centralized baseline, on one torch.distributed engine. A first run: "
               "fedpar simulate --clients 10 --rounds 10 --dataset digits; 'fedpar COMMAND --help' for a command's "
               "options")


# torch's OpenMP threads spin while they wait for work, on cores another process may need: a coordinator and two
# agents on one 2-core machine (the first deployment) took 4 s a digits round, not 0.04 s. A command whose process
# shares the cores waits passively (set before torch loads; a user's own OMP_WAIT_POLICY stands); train has them to
# itself (waiting passively cost it 3-5% on MNIST's CNN, 2 cores).
CORES_TO_ITSELF = {"train"}


def wait_passively_unless_alone(command: str) -> None:
    """Make OpenMP wait passively for ``command``'s process and its children unless it has the cores to itself."""
    if command not in CORES_TO_ITSELF:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _available() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(f"fedpar.cli.{module}") is not None:
            out[name] = (module, help_text)
    return out


def _version() -> str:
    """The installed fedpar's version (pyproject's)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("fedpar")
    except PackageNotFoundError:
        return "unknown (not installed)"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless the help says what its default means ("default: never")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser: every available subcommand in full, or only ``only`` in full (the others are listed
    by name and help, so `fedpar --help` imports no subcommand's module)."""
    parser = FedparParser(prog="fedpar", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"fedpar {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _available().items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        mod = importlib.import_module(f"fedpar.cli.{module}")
        p = sub.add_parser(name, help=help_text, description=mod.__doc__,
                           formatter_class=DefaultsHelpFormatter)
        p.add_argument("--config", metavar="FILE", type=text,  # --config "$CONFIG" with it unset ran on defaults
                       help=f"TOML file whose [{name}] table (or, in a file without one, its top level) sets "
                            "defaults; flags override it")
        p.add_argument("--debug", action="store_true", help="show the traceback of an error, not just its one line")
        add_log_level_argument(p, getattr(mod, "LOG_LEVEL", "info"))
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def _coordinators_own(command: str, agent: FedparParser) -> set[str]:
    """The flags of fedpar serve that ``agent``, the parser of `fedpar client`, lacks (none for other commands): given
    to an agent, they are the coordinator's, not misspellings of the agent's (--compression: not --precision)."""
    if command != "client":
        return set()
    serve = subcommand_parser(build_parser(only="serve"), "serve")
    own = set(agent.long_options())
    return {flag for flag in set(serve.long_options()) - own if elsewhere_called(flag, own) is None}


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` inside ``parser`` (from :func:`build_parser`)."""
    return parser._subparsers._group_actions[0].choices[name]


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as cli/entry.py does, for main() called directly
    dump_stacks_on_signal()  # kill -USR1: where a run that seems stuck waits
    wait_passively_unless_alone(argv[0] if argv else "")
    if not argv or argv[0] not in _available():
        parser = build_parser(only="")
        parser.print_help() if not argv else parser.parse_args(argv)
        return 2
    args = None
    try:
        set_grpc_verbosity(argv[1:])
        parser = build_parser(only=argv[0])
        subparser = subcommand_parser(parser, argv[0])
        from_file = apply_config_defaults(subparser, argv[1:], argv[0])
        args, extra = parser.parse_known_args(argv)  # a bad option: one line and SystemExit(2) (cli/argtypes.py)
        args._typed = given_settings(subparser, argv[1:], frozenset())
        args._given = args._typed | from_file
        if extra:  # said by the subcommand, which knows its options: its own --help
            subparser.unrecognized(extra, _coordinators_own(argv[0], subparser))
        refuse_unswitched(args, switched_options(subparser))  # e.g. --secagg-clip without --secure-aggregation
        if args.log_level:
            setup_logging(args)
        return int(args._module.run(args) or 0)
    except ConfigError as exc:
        print(f"fedpar {argv[0]}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM where a command stops on it (parallel/stopping.py)
        if runs_service(argv):
            print(f"fedpar service: stopped by {signal_name(exc)}", flush=True)  # as later: cli/serve.py run()
            return 0
        print(f"fedpar {argv[0]}: interrupted", file=sys.stderr)
        return exit_code(signal_name(exc))
    except (UserError, TaskError, OSError) as exc:  # a set-up or task mistake: one line (--debug: the traceback)
        if isinstance(exc, BrokenPipeError) and reader_left():  # '... | head': not a socket's broken pipe
            return quiet_exit_for_pipe()
        if args is not None and args.debug:
            raise
        # a UserError's line is all there is to it; another error's traceback shows where it came from
        hint = "" if isinstance(exc, UserError) else " (--debug shows the traceback)"
        print(f"fedpar {argv[0]}: {describe(exc)}{hint}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)


if __name__ == "__main__":
    from fedpar.cli.leaving import leave

    leave(main())
