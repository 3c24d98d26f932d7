"""`fedpar ...` run by its main in the test's own process, logging as a fresh `fedpar` process would."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def environment_put_back() -> Iterator[None]:
    """os.environ and the SIGUSR1 handler as they were, after a command's main ran here: main sets GRPC_VERBOSITY,
    TORCH_CPP_LOG_LEVEL and OMP_WAIT_POLICY for its own process (setdefault) and a handler that dumps stacks, which a
    later test (and the processes it starts with os.environ) would otherwise inherit."""
    environment, on_usr1 = dict(os.environ), signal.getsignal(signal.SIGUSR1)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)
        signal.signal(signal.SIGUSR1, on_usr1)


@contextlib.contextmanager
def logging_as_a_fresh_process() -> Iterator[None]:
    """The root logger without pytest's handlers while a command's main runs here: its setup_logging
    (logging.basicConfig) then logs to sys.stderr as it would in a process of its own, and so does a process it forks
    (which inherits the handler), so that capfd holds what the process's stderr would have. The levels start as a
    fresh process's (root WARNING, the fedpar logger unset: an earlier in-process command may have set it), and
    Flower's console handler writes to the standard error of now; pytest's handlers, the root's level, the fedpar
    logger's and Flower's handler's stream are put back after."""
    root, fedpar = logging.getLogger(), logging.getLogger("fedpar")
    handlers, level, fedpar_level = root.handlers[:], root.level, fedpar.level
    # Flower's console handler holds the sys.stderr of the moment flwr was imported: under pytest, the capture of the
    # test that first imported it (gone since); a fresh process's writes to its standard error
    flower = [(h, h.stream) for h in logging.getLogger("flwr").handlers if type(h) is not logging.FileHandler
              and isinstance(h, logging.StreamHandler)]
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    fedpar.setLevel(logging.NOTSET)
    for handler, _ in flower:
        handler.stream = sys.stderr  # not setStream: it flushes the stream it replaces, which may be closed
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        fedpar.setLevel(fedpar_level)
        for handler, stream in flower:
            handler.stream = stream


def flushes_denormals() -> bool:
    """Whether torch flushes denormal floats to zero in this process now (torch can set it, not say it)."""
    import torch

    return (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item() == 0.0


@contextlib.contextmanager
def torch_state_put_back() -> Iterator[None]:
    """torch's thread count and denormal flushing as they were, after a command's main ran here: a command sets
    them for its own process (client --threads, fedpar.parallel.device.flush_denormals), which would change what
    later tests in this worker compute."""
    import torch

    threads, flushing = torch.get_num_threads(), flushes_denormals()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(flushing)


def run_main(argv: list[str], capfd, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """`fedpar ARGV` by its main in this process, from ``cwd``: its exit code, and what it and the processes it
    started wrote to stdout and stderr (file descriptors 1 and 2, captured by ``capfd``, its log included), as a
    subprocess's would be (a SystemExit, as argparse's refusal of an option raises, gives its code). The torch
    threads and denormal flushing a command sets for itself are put back after (:func:`torch_state_put_back`), and
    so are the environment and the signal handler it sets (:func:`environment_put_back`)."""
    from fedpar.cli.main import main

    capfd.readouterr()
    with pytest.MonkeyPatch.context() as mp, logging_as_a_fresh_process(), environment_put_back(), \
            torch_state_put_back():
        if cwd is not None:
            mp.chdir(cwd)
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's refusal of an option: the exit code a process would end with
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["fedpar", *argv], code, out, err)


def main_here(*argv: str) -> subprocess.CompletedProcess:
    """`fedpar ARGV` run by its main in this process, without pytest's capture: its exit code (a usage error's
    SystemExit too) and what it printed, as a finished process's (the environment put back after, as by
    :func:`run_main`, and torch's threads and denormal flushing)."""
    import io

    from fedpar.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), environment_put_back(), \
            torch_state_put_back():
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())
