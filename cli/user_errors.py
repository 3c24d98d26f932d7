"""Mistakes in how a command was set up, reported as one line instead of a traceback."""

from __future__ import annotations

import errno
import os
import sys

from fedpar.parallel.stopping import exit_code


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
        }.get(exc.errno, "check the path and the permissions")
        notes = "".join(f"; {note}" for note in getattr(exc, "__notes__", ()))  # e.g. what was written all the same
        return f"{exc.strerror or exc}{_where(exc.filename)}; {advice}{notes}"
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
            if not part.is_dir():
                raise UserError(f"{option} {path}: {part} is a file, not a folder; remove it or point {option} "
                                "at a folder")
            return


def check_port_free(host: str, port: int, option: str = "--port") -> None:
    """UserError if another process listens on ``host:port`` (port 0 always passes)."""
    import socket

    if not port:
        return
    try:
        infos = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}; check --host") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is in use by another process; stop it or pick another "
                                f"{option} (0 picks a free one)", exit_code=1) from None
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}; check --host and {option}",
                            exit_code=1) from None


def run_exit_code(command: str, summary: dict, signal_name: str | None = None, task: str | None = None) -> int:
    """128 + the number of the signal that stopped an interrupted run (130 for SIGINT, the default; 143 for
    SIGTERM), 1 (with one line saying so: the members' own failure when their code failed the last round's tasks,
    naming ``task``, the --task reference) when every round failed, else 0."""
    if summary.get("interrupted"):
        print(f"{command}: interrupted after {summary['rounds']} completed rounds", file=sys.stderr)
        return exit_code(signal_name or "SIGINT")
    if summary["rounds"] and summary["failed_rounds"] == summary["rounds"]:
        failed = f"{command}: every round failed ({summary['rounds']} of {summary['rounds']})"
        error = summary.get("training_error")
        if error and task:
            print(f"{failed}: the task's {error}: fix the task ({task})", file=sys.stderr)
        elif error:
            print(f"{failed}: the members' {error}", file=sys.stderr)
        else:
            print(f"{failed}: too few updates arrived (see close_reason in metrics.jsonl); check --min-reports, "
                  "--deadline and the agents' logs", file=sys.stderr)
        return 1
    return 0
