"""The ``fedpar`` console script: :func:`entry` runs the command, a Ctrl-C while it loads included."""

from __future__ import annotations

import signal
import sys

from fedpar.cli.leaving import arrange, leave


def entry() -> None:
    """Run ``fedpar`` (cli/main.py :func:`main`) and exit with its code, without the interpreter's teardown. A
    Ctrl-C before the command's own handling is in place (while its modules load, about 0.5 s) ends it with one
    line and 130 (a service's with 0), as one later does."""
    arrange()  # before any module that adds an exit handler is imported
    # A process started in the background by a shell script inherits SIGINT ignored, and Python then keeps it
    # so: Ctrl-C (or kill -INT) must stop a coordinator or a simulation however it was started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    try:
        from fedpar.cli.log_level import set_grpc_verbosity  # (light: no gRPC)

        set_grpc_verbosity(sys.argv[2:])  # before gRPC loads (cli/main.py's imports): it reads GRPC_VERBOSITY then
        from fedpar.cli.main import main
        code = main()
    except KeyboardInterrupt:
        from fedpar.cli.user_errors import runs_service  # (light: no torch, no gRPC)

        if runs_service(sys.argv[1:]):
            print("fedpar service: stopped by SIGINT", flush=True)  # as later (a service stops cleanly: exit 0)
            code = 0
        else:
            print(f"{' '.join(['fedpar', command]).strip()}: interrupted", file=sys.stderr)
            code = 130
    leave(code)
