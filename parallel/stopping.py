"""Stopping a run by signal: SIGINT (Ctrl-C), SIGTERM (what systemd, Docker or a script sends) and SIGHUP (its terminal
closed, or `kill -HUP`) all ask it to stop.

Inside :func:`stop_on_signals` the first of them raises :class:`StopRequested` in the main thread. It is a
KeyboardInterrupt, so whatever stops a run cleanly on Ctrl-C (ending the rounds, writing the summary, the model and
the last checkpoint) does the same for SIGTERM and SIGHUP; the process then exits 128 + the signal's number (130,
143, 129). A SIGHUP ignored from birth (``nohup``) stays ignored. The
same signal again within :data:`REPEAT_SECONDS` is the same request (``timeout -s INT`` and ``kill -INT -PGID``
reach a process once by its id and once by its group). A later second signal ends the process at once: what it was
writing is lost, never torn, since every output is replaced atomically (protocol/atomicfile.py) and a checkpoint is
published only once complete (server/checkpoint.py). Work that must not stop half done holds the first signal
until it ends (:class:`held_stops`: `fedpar train`'s optimizer step, whose weights it then keeps).

A process with a launcher (a rank of `fedpar serve --aggregator-ranks N`) leaves second signals to the launcher,
which stops its ranks in order and kills them if they take too long (parallel/init.py spawn).
"""

from __future__ import annotations

import _thread
import contextlib
import copyreg
import faulthandler
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Callable

# SIGHUP as SIGTERM: a closed terminal (or `kill -HUP`) ended a run at once, by the default action, without a word
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# ignored from birth, these stay ignored: a rank whose launcher stops it (SIGINT, SIGHUP: a terminal's Ctrl-C and
# hangup reach its whole process group), or a command started under nohup (SIGHUP)
KEPT_IGNORED = {signal.SIGINT, signal.SIGHUP}
DROPPED_RETRY_SECONDS = 0.05  # a dropped StopRequested is raised again after this (dropped_stop)
HELD_SIGNALS = set(STOP_SIGNALS)  # blocked while processes their parent stops start (interrupts_held)
REPEAT_SECONDS = 1.0  # a person who means "now" presses Ctrl-C again later than a signal delivered twice arrives


class StopRequested(KeyboardInterrupt):
    """A signal asked this process to stop (the first one: there is time to write what must be written)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def __reduce__(self):
        # pickle and copy rebuild an exception as type(self)(*self.args), and its args hold the signal's name: DCP
        # pickles a stop raised inside its save or load to gather it from every rank, and that raised a ValueError
        return copyreg.__newobj__, (type(self), *self.args), self.__dict__


def signal_name(exc: BaseException) -> str:
    """The signal behind a KeyboardInterrupt: a StopRequested's, else SIGINT (Python's own Ctrl-C)."""
    return signal.Signals(exc.signum).name if isinstance(exc, StopRequested) else "SIGINT"


def exit_code(name: str = "SIGINT") -> int:
    """What a process stopped by signal ``name`` exits with, as a shell reports it: 128 + its number."""
    return 128 + int(signal.Signals[name])


class Received:
    """The first stop signal :func:`stop_on_signals` took, by name (None: none yet)."""

    signal: str | None = None
    at: float = 0.0  # when it came (time.monotonic)
    holding: bool = False  # inside a held_stops block: the first signal waits for its end
    pending: int | None = None  # the signal number it holds
    dropped: int | None = None  # the signal whose StopRequested was raised where exceptions are dropped
    rescued: bool = False  # raise_lost_stop raised it once already

    def exit_code(self) -> int:
        """What the process exits with for it (130 when none came: a KeyboardInterrupt raised otherwise)."""
        return exit_code(self.signal or "SIGINT")


_active: Received | None = None  # the innermost stop_on_signals block's, on the main thread


class held_stops:
    """Inside the block (within :func:`stop_on_signals`, on the main thread) the first stop signal raises its
    StopRequested only at the block's end: work that must not stop half done (an optimizer step, whose weights
    are then kept) finishes first. A later signal still exits at once. Elsewhere it does nothing."""

    def __enter__(self) -> None:
        self.received = _active if threading.current_thread() is threading.main_thread() else None
        if self.received is not None:
            self.received.holding = True

    def __exit__(self, kind, exc, tb) -> None:
        received = self.received
        if received is not None:
            received.holding = False
            if received.pending is not None and exc is None:
                signum, received.pending = received.pending, None
                raise StopRequested(signum)


@contextlib.contextmanager
def stop_on_signals(second_exits: bool = True, on_second: Callable[[], None] | None = None) -> Iterator[Received]:
    """Inside the block the first SIGINT, SIGTERM or SIGHUP raises StopRequested in the main thread (and is noted in
    the Received it yields); the same one within REPEAT_SECONDS is ignored; a later one calls ``on_second()`` and ends
    the process at once with 128 + its number, or, without ``second_exits``, is ignored (a rank whose launcher
    escalates). A SIGINT or SIGHUP ignored from birth (a rank of a launcher that stops it; nohup) stays ignored. Off
    the main thread (where Python cannot take signals) the block runs as it is."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        yield Received()
        return
    # Inside another such block (a command's, around a launcher's) both share what came: a signal the inner one
    # took is the first for the outer one too, so another while the command writes what completed exits at once.
    received, outer = _active or Received(), _active
    _active = received

    def handle(signum: int, frame) -> None:
        if received.dropped == signum:  # raised again (dropped_stop, or out of logging), now where it may be
            if _in_logging(frame):
                _raise_again(signum)
                return
            received.dropped = None
            raise StopRequested(signum)
        if received.signal is None:
            received.signal, received.at = signal.Signals(signum).name, time.monotonic()
            if received.holding:
                received.pending = signum
                return
            if _in_logging(frame):
                received.dropped = signum
                _raise_again(signum)
                return
            raise StopRequested(signum)
        if signal.Signals(signum).name == received.signal and time.monotonic() - received.at < REPEAT_SECONDS:
            return  # the first one, delivered again
        if second_exits:
            if on_second is not None:
                on_second()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signum)

    def dropped_stop(unraisable) -> None:
        stop = unraisable.exc_value
        if not isinstance(stop, StopRequested):
            previous_hook(unraisable)
            return
        # handle() raised it where Python drops exceptions (a weakref callback, as an import releases its module
        # lock): the process went on as if no signal had come, and its launcher waited out its grace. Raised again
        # once that code has returned (again if dropped again).
        received.dropped = stop.signum
        _raise_again(stop.signum)

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    previous_hook = sys.unraisablehook
    for s in STOP_SIGNALS:
        if not (s in KEPT_IGNORED and previous[s] == signal.SIG_IGN):
            signal.signal(s, handle)
    sys.unraisablehook = dropped_stop
    try:
        yield received
    finally:
        _active = outer
        sys.unraisablehook = previous_hook
        for s, handler in previous.items():
            signal.signal(s, handler)


def _in_logging(frame) -> bool:
    """Whether the main thread was interrupted in the logging module's own code: a StopRequested raised there, between
    a lock's acquire and the ``try`` that releases it, left logging's lock held by the main thread, and every other
    thread that logged then waited for ever (a coordinator stopped as it started waited out its launcher's 60 s)."""
    return frame is not None and frame.f_code.co_filename == logging.__file__


def _raise_again(signum: int) -> None:
    """Deliver stop signal ``signum`` to the main thread again in :data:`DROPPED_RETRY_SECONDS` (its handler then
    raises the StopRequested it could not raise where it came)."""
    again = threading.Timer(DROPPED_RETRY_SECONDS, _thread.interrupt_main, args=(signum,))
    again.daemon = True
    again.start()


def raise_lost_stop() -> None:
    """In a main-thread wait loop inside :func:`stop_on_signals` (one its StopRequested would have left): raise the
    stop of a signal that came but whose StopRequested never got here, so that the run still stops. CPython drops an
    exception that a handler raises inside C code that clears errors (a dict lookup's ``__eq__``, a C extension's
    callback): the run went on to its last round (1 run in about 12 of a stop during set-up, under load). A
    stop held (:class:`held_stops`) or already being raised again (``dropped``) is left to that, and one is raised
    here at most once: a caller that took it and waits again is not stopped twice."""
    received = _active
    if (received is None or received.signal is None or received.holding or received.dropped is not None
            or received.rescued or threading.current_thread() is not threading.main_thread()):
        return
    received.rescued = True
    raise StopRequested(int(signal.Signals[received.signal]))


AWAKE_SECONDS = 0.25  # how long a wait on the main thread sleeps at a time: Ctrl-C is acted on within it


def wait_awake(event: threading.Event, timeout: float | None = None, stops: bool = False) -> bool:
    """``event.wait(timeout)``, waking every AWAKE_SECONDS: a signal that the kernel gives another thread of the
    process only flags it for the main thread, whose wait with no timeout it never interrupts (Ctrl-C was lost).
    ``stops``: a wait that a stop leaves (a run's), which raises a lost stop at each wake (:func:`raise_lost_stop`)."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        if stops:
            raise_lost_stop()
        left = AWAKE_SECONDS if end is None else min(AWAKE_SECONDS, end - time.monotonic())
        if event.wait(max(left, 0.0)):
            return True
        if end is not None and time.monotonic() >= end:
            return False


@contextlib.contextmanager
def interrupts_held(start_method: str = "spawn") -> Iterator[Callable[[], None]]:
    """Start processes inside the block that their parent stops: they are born with SIGINT, SIGTERM and SIGHUP blocked
    and take them as :func:`parent_stops_this` sets, first thing: SIGINT and SIGHUP ignored (Ctrl-C and a closed
    terminal reach a terminal's whole process group), so that they print no traceback of theirs, and SIGTERM as by
    default. A forked child held its parent's handlers until then, and a SIGTERM its parent sent before the child ran
    that far (not yet given the CPU on a loaded machine) raised the parent's StopRequested in the child, where torch's
    worker swallows it: the child went on, or ended without a word, and its parent took it to have said what completed.
    A SIGINT that comes to this process meanwhile, to whichever thread, is noted and raised at ``release()`` or the
    block's end, to the handler in place then (a SIGTERM or SIGHUP waits, blocked, until then). ``start_method``: how
    the block starts processes. Off the main thread the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    with _hangups_blocked():
        if start_method != "fork":
            # multiprocessing starts its resource tracker at the first spawned process and then unblocks SIGINT
            # whatever the mask was (resource_tracker.ensure_running): started first, the block's spawns leave the
            # mask alone
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
        if start_method == "forkserver":  # the server, started by the block's first child, would keep the mask
            from multiprocessing import forkserver

            forkserver.ensure_running()
    came: list[int] = []
    # noted, not ignored: the kernel hands a process's signal to any thread that does not block it (a store's, a
    # gRPC poller's), and one ignored there was lost
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    blocked = HELD_SIGNALS - signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)  # what children get
    open_ = [True]

    def release() -> None:
        if open_[0]:
            open_[0] = False
            signal.signal(signal.SIGINT, previous)
            if blocked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
            if came:
                signal.raise_signal(signal.SIGINT)
    try:
        yield release
    finally:
        release()


@contextlib.contextmanager
def _hangups_blocked() -> Iterator[None]:
    """Processes started inside the block keep SIGHUP blocked for good: multiprocessing's resource tracker and fork
    server, which ignore Ctrl-C, since a closed terminal's SIGHUP reaches its whole process group too. Ended by it,
    the fork server took its children's exits with it (each read as 255: rank 0 'gone' while it wrote what its run
    completed), and the tracker was started again with a warning. One that comes here meanwhile waits until the end."""
    was = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        if signal.SIGHUP not in was:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})


def parent_stops_this() -> None:
    """In a process started inside :func:`interrupts_held`, first thing: SIGINT and SIGHUP are ignored from now on
    (its parent stops it), SIGTERM ends it as by default (a forked child had its parent's handler), and none is
    blocked any longer (a SIGINT or SIGHUP that came meanwhile is dropped; a SIGTERM ends it now)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)


def default_terminate() -> None:
    """SIGTERM ends this process as it does by default: a forked child may have its parent's handler
    (:func:`stop_on_signals`), and its parent ends it with SIGTERM."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def dump_stacks_on_signal() -> None:
    """``kill -USR1 PID`` prints the stack of every thread of this process on stderr and the process goes on: where a
    run that seems stuck waits (where there is no SIGUSR1, or off the main thread, nothing)."""
    stderr = sys.__stderr__  # the process's own (sys.stderr may be a capture without a file descriptor)
    if not hasattr(signal, "SIGUSR1") or stderr is None:
        return

    def dump(signum, frame) -> None:
        # On the main thread, holding the interpreter lock: faulthandler's own handler walked the threads from the
        # signal itself, while a gRPC stream's thread could be ending, and a worker died of it (SIGSEGV) in CI.
        with contextlib.suppress(OSError, ValueError):  # a closed stderr: nothing to print on
            faulthandler.dump_traceback(file=stderr, all_threads=True)

    with contextlib.suppress(ValueError):  # not the main thread: signal handlers are the main thread's
        signal.signal(signal.SIGUSR1, dump)
        signal.siginterrupt(signal.SIGUSR1, False)  # a wait in gRPC's or gloo's threads restarts, as it did before


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Have the kernel send ``signum`` to this process when its parent exits (Linux; elsewhere nothing); sent now
    if the parent of this multiprocessing child is gone already. A fork server's child (parallel/init.py
    rank_start_method) has the server for its parent in the kernel's eyes, which lives on while any of its children
    does: a thread of its own watches the launcher instead."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # a fork server's child (the server's death is not its
        _watch_launcher(parent.pid, signum)  # launcher's), or its launcher died just now
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent.pid:  # it died before the line above
        os.kill(os.getpid(), signum)


def _watch_launcher(pid: int, signum: int) -> None:
    """Send ``signum`` to this process once process ``pid`` has ended (now, if it has)."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signum)
        return
    except OSError:  # a kernel before 5.3: asked once a second
        handle = None

    def watch() -> None:
        if handle is not None:
            select.select([handle], [], [])
        else:
            while alive(pid):
                time.sleep(1.0)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="fedpar-launcher-watch", daemon=True).start()


def alive(parent: int) -> bool:
    """Whether this process's launcher (pid ``parent``) still runs. A child of a fork server has the server for its
    parent in the kernel's eyes (its death signal follows the server, which ends when the launcher does), so the
    launcher's pid is asked of the kernel when it is not the parent's."""
    if os.getppid() == parent:
        return True
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user has that pid now
        return True
    return True
