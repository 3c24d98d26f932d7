"""Mistakes in how a command was set up, reported as one line instead of a traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import sys

from fedpar.parallel.stopping import exit_code
from fedpar.wording import counted


class UserError(Exception):
    """Something the user must change (an option, a path, a port), with the line that says what to do."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def describe(exc: BaseException) -> str:
    """One line for a UserError or an OSError: what is wrong, on which path, and what to do."""
    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno is not None:
        advice = {
            errno.ENOENT: "check the path",
            errno.ENOTDIR: "a folder was expected there: pick another path",
            errno.EEXIST: "remove it or pick another path",
            errno.EISDIR: "a folder is in the way: move it or pick another path",
            errno.EACCES: "check the permissions, or pick another path",
            errno.ENOSPC: "free some disk space there, or pick a folder on another disk",
            errno.EDQUOT: "free some of your disk quota, or pick a folder on another disk",
            errno.EFBIG: "it is larger than this process may write (ulimit -f) or the disk allows; pick another disk",
            errno.EADDRINUSE: "another process uses that port: stop it or pick another port",
            errno.EINVAL: "pick another path",
        }.get(exc.errno, "check the path and the permissions" if exc.filename else "")
        notes = "".join(f"; {note}" for note in getattr(exc, "__notes__", ()))  # e.g. what was written all the same
        # no path and no known cause (a process's "No child processes"): no advice, which would only mislead
        return f"{exc.strerror or exc}{_where(exc.filename)}{'; ' if advice else ''}{advice}{notes}"
    return str(exc)


def _where(filename) -> str:
    """': NAME in folder FOLDER' (the folder in full, so that the disk it is on can be told), or '' for none."""
    if filename is None or filename == "":
        return ""
    path = os.fsdecode(filename)
    folder = os.path.dirname(os.path.abspath(path))
    return f": {os.path.basename(path) or path} in folder {folder}"


def check_output_folder(path, option: str = "--out") -> None:
    """UserError unless ``path`` is a folder or can be made one (a file there, or a file on the way, is named)."""
    from pathlib import Path

    path = Path(path)
    for part in (path, *path.parents):
        if part.exists():
            if part.is_file():
                raise UserError(f"{option} {path}: {part} is a file, not a folder; move it aside or point {option} "
                                "at a folder")
            if not part.is_dir():  # a device such as /dev/null, a pipe, a socket: nothing to move aside
                raise UserError(f"{option} {path}: {part} is not a folder (a device, pipe or socket); point {option} "
                                "at a folder")
            return


def check_folder_writable(path, option: str) -> None:
    """UserError, saying what to do, unless ``path`` is a folder this user can write in or can make (tried: what the
    try made is removed again, so that a command refused later leaves no folder behind)."""
    import tempfile
    from pathlib import Path

    path = Path(path)
    made = [folder for folder in (path, *path.parents) if not folder.exists()]  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        if path.is_dir():  # it is there: what failed is writing in it
            raise UserError(f"{option} {path}: cannot write in the folder: {exc.strerror or exc}; give a folder this "
                            "user can write") from None
        raise UserError(f"{option} {path}: cannot make the folder: {exc.strerror or exc}; give a folder this user "
                        "can make, or one that exists") from None
    finally:
        _remove_empty(made)


def hold_output_folder(path, option: str = "--out") -> contextlib.ExitStack:
    """The folder ``path`` (made if missing) held for this run alone until the returned stack closes: a second run
    into it is a UserError naming the first one's pid (two runs' rows went into one metrics.jsonl). The lock file
    goes when the stack closes."""
    from pathlib import Path

    from fedpar.protocol.file_lock import LockHeld, hold

    path = Path(path)
    made = [folder for folder in (path, *path.parents) if not folder.exists()]  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = hold(path / OUTPUT_LOCK)
    except LockHeld as held:
        raise UserError(f"{option} {path} is in use by another fedpar run (pid {held.pid}); wait for it to end, or "
                        f"give another {option}") from None
    except OSError as exc:
        if path.is_dir():  # it is there: what failed is writing in it
            raise UserError(f"{option} {path}: cannot write in the folder: {exc.strerror or exc}; give a folder this "
                            "user can write") from None
        raise UserError(f"{option} {path}: cannot make the folder: {exc.strerror or exc}") from None
    held = contextlib.ExitStack()
    held.callback(_remove_empty, made)  # a start refused before it wrote anything leaves no folder behind
    held.callback(lock.release, remove=True)  # no run leaves it behind (one that opened it meanwhile takes a new one)
    return held


def _remove_empty(folders: list) -> None:
    """Remove ``folders`` (deepest first) while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty: the run wrote there
            return


OUTPUT_LOCK = ".fedpar.lock"


def check_port_free(host: str, port: int | None, option: str = "--port", exit_code: int = 2,
                    host_option: str = "--host") -> None:
    """UserError (``exit_code``: 2, as every other port mistake) if another process listens on ``host:port``, or if
    ``host`` is no address of this machine (port 0 too: gRPC would say so only in a log line of its own); port None
    always passes. ``option`` and ``host_option`` are the flags the line names."""
    import socket

    if port is None:
        return
    try:
        infos = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}; check {host_option}", exit_code) from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is in use by another process; stop it or pick another "
                                f"{option} (0 picks a free one)", exit_code) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise UserError(f"cannot listen on {host}: it is not an address of this machine; check {host_option} "
                                "(0.0.0.0 listens on every interface)", exit_code) from None
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}; check {host_option} and {option}",
                            exit_code) from None


def check_rank_ports(host: str, port: int, ranks: int, others: dict[int, str]) -> None:
    """UserError (exit 2) unless the ports aggregator ranks 1..``ranks``-1 listen on, ``port`` + rank, are free and
    none of them is one of ``others`` (port -> the option that names it); port 0: each rank picks a free one."""
    if not port or ranks <= 1:
        return
    needed = range(port + 1, port + ranks)
    span = (f"--aggregator-ranks {ranks} needs ports {port}..{port + ranks - 1} (rank r listens on --port + r)")
    if port + ranks - 1 > 65535:  # getaddrinfo wraps 65536 to 0, so such a rank would take a free port in silence
        raise UserError(f"{span}, but ports end at 65535; pick a --port of at most {65536 - ranks}")
    for other, option in sorted(others.items()):
        if other in needed:
            raise UserError(f"{span}, but {other} is {option}; pick a --port or {option} outside that range")
    for rank_port in needed:
        try:
            check_port_free(host, rank_port)
        except UserError:
            raise UserError(f"{span}, but {rank_port} is in use by another process; stop it or pick another --port "
                            "(0 lets each rank pick a free one)") from None


def runs_service(argv: list[str]) -> bool:
    """Whether ``argv`` (the words after ``fedpar``) start the long-lived service, which a signal stops cleanly (exit
    0): ``serve --state``."""
    return bool(argv) and argv[0] == "serve" and any(a == "--state" or a.startswith("--state=") for a in argv[1:])


def say_agent_interrupted(summary: str | None) -> None:
    """The one line a stopped ``fedpar client`` says: what it did (``summary``, its stats'), or no more than that it
    stopped where a rank that knows said nothing."""
    print(f"fedpar client: interrupted{f' after {summary}' if summary is not None else ''}", file=sys.stderr,
          flush=True)


def agent_exit_code(agent_id: str, stats) -> int:
    """An agent's exit code once its coordinator ended the run: 1, with one line saying so, when none of its tasks
    ended in an update taken and its own side failed one at least (AgentStats.none_taken: an operator's supervisor
    then sees the agent took no part), else 0 (``stats``: its AgentStats)."""
    none_taken = stats.none_taken()
    if none_taken is None:
        return 0
    print(f"fedpar client: {agent_id}: {none_taken}", file=sys.stderr, flush=True)
    return 1


def run_exit_code(command: str, summary: dict, signal_name: str | None = None, task: str | None = None) -> int:
    """128 + the number of the signal that stopped an interrupted run (130 for SIGINT, the default; 143 for
    SIGTERM), 1 (with one line saying so: the members' own failure when their code failed the last round's tasks,
    naming ``task``, the --task reference) when every round failed, else 0."""
    if summary.get("interrupted"):
        # a Flower App's run counts its rounds in Message exchanges: a ServerApp's server round is two (train, evaluate)
        done = "Message exchange" if "flower" in summary else "completed round"
        print(f"{command}: interrupted after {counted(summary['rounds'], done)}", file=sys.stderr)
        return exit_code(signal_name or "SIGINT")
    failed = every_round_failed(summary, task)
    if failed:
        print(f"{command}: {failed}", file=sys.stderr)
        return 1
    return 0


def every_round_failed(summary: dict, task: str | None = None,
                       options: str = "--min-reports, --deadline") -> str:
    """Why a run whose every round failed failed (the members' own failure when their code failed the last round's
    tasks, naming ``task``, the --task reference; else too few updates, and ``options`` to check), or "" when a
    round succeeded or none ran."""
    from fedpar.client.model_fit import MODEL_DIFFERS, RESTART  # here: this module stays light (no gRPC)

    if not summary["rounds"] or summary["failed_rounds"] != summary["rounds"]:
        return ""
    failed = f"every round failed ({summary['rounds']} of {summary['rounds']})"
    error = summary.get("training_error")
    diverged = "; lower --lr (training diverged)" if "NaN or Inf" in (error or "") else ""
    if error and error.startswith(MODEL_DIFFERS):  # the agent's build differs, not the task's code
        return f"{failed}: an agent's {error}; {RESTART}"
    if error and task:
        return f"{failed}: the task's {error}{diverged}: fix the task ({task})"
    if error:
        return f"{failed}: the members' {error}{diverged}"
    refused = summary.get("refused_because")
    if refused:  # it said 'too few updates arrived ... check --min-reports, --deadline' of updates all refused
        hint = "; lower --lr (training diverged)" if "NaN or Inf" in refused else ""
        return f"{failed}: the coordinator refused every update, e.g. {refused}{hint}"
    return (f"{failed}: too few updates arrived (see close_reason in metrics.jsonl); check {options} and the agents' "
            "logs")


def reader_left() -> bool:
    """Whether standard output is a pipe whose reader left (``fedpar ... | head``: POLLERR on its end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no file behind stdout (a capture)
        return False


def quiet_exit_for_pipe() -> int:
    """Exit code 141 (128 + SIGPIPE, what the shell reports for a tool a closed pipe ended), saying nothing, as Unix
    tools do; stdout goes to /dev/null so that the interpreter's last flush does not fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141
