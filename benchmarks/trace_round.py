"""How many fedpar source files one round runs code in, and how many one upload crosses (issue 26's "the round is
short to read").

Starts `fedpar serve` and one `fedpar client` (digits, one round, K = 1, every other setting at its default) as two
processes, each under a profiler (``sys.setprofile`` on every thread) that notes the fedpar files whose functions
are called:
- the round: on the coordinator from the start of the round (``Coordinator._run_round``) to the end of the run
  (``Members.finish``), leaving out what the main thread runs meanwhile (the command's own wait loop: the live
  progress bar, the stop check; it polls from start to end, and the coordinator and its workers run on threads of
  their own); on the agent from its task's arrival (``ClientRuntime._dispatch``) to the end of that task.
  Start-up, joining and shutting down are left out;
- one upload: on the agent from the update's upload call (``PlainUpload.upload``) to its reply, on that thread;
  on the coordinator from the upload RPC (``UploadSmall`` / ``UploadUpdate``) to the end of its intake
  (``UploadIntake.settle``), leaving out what the round's own task (``Coordinator.run`` and the round it awaits)
  runs meanwhile (closing the round) and, as in the round, what the main thread runs meanwhile, as the agent's
  window keeps to the upload's thread.
A file counts when any of its code runs in a window: a function of it is called, or a frame of it that was entered
before the window goes on (it calls into C, or a callee returns to it). Only files of the rooms pyproject.toml maps
to fedpar.* count (no third-party code, no tests or benchmarks); generated protobuf modules do not. Prints the
counts and the files, and writes them (benchmarks/results/trace_round.json by default: the envelope of
benchmarks/results.py, the counts against the targets as ratios); docs/explanation/traced-round.md has the figures.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import RESULTS, write_results  # noqa: E402  (benchmarks/, this script's folder)

from fedpar.cli.argtypes import FedparParser  # noqa: E402

# (file, function) that open and close each window; a rename in the code is a rename here
MARKS = {
    "server": {"round": ("server/coordinator.py", "_run_round"),
               "round_end": {("server/members.py", "finish"), ("server/ranks/plane.py", "_ready")},
               "upload": {("server/app.py", "UploadSmall"), ("server/app.py", "UploadUpdate"),
                          ("server/dataplane.py", "_upload")},
               "upload_end": ("server/uploads.py", "settle"),
               "not_upload": {("server/coordinator.py", "_run_round"), ("server/coordinator.py", "run")}},
    "agent": {"round": ("client/runtime.py", "_dispatch"), "upload": {("client/transfer.py", "upload")}},
}


class Tracer:
    """Notes the fedpar files whose functions are called, in the round and upload windows (one process)."""

    def __init__(self, side: str, root: Path):
        self.root = root
        self.rooms = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
                         .values())  # the folders mapped to fedpar.*
        self.marks = MARKS[side]
        self.side = side
        self.round: set[str] = set()
        self.upload: set[str] = set()
        self.functions: dict[str, set[str]] = {"round": set(), "upload": set()}  # file:function, for the JSON
        self.seen: set[str] = set()  # the windows' markers that fired
        self.in_round = self.in_upload = False
        self.round_frame = self.upload_frame = None  # the agent's windows end when these frames return
        self.upload_thread: int | None = None
        self._files: dict[str, str | None] = {}

    def rel(self, filename: str) -> str | None:
        """``filename`` relative to the repository if it is a fedpar source file, else None."""
        if filename not in self._files:
            try:
                rel = Path(filename).resolve().relative_to(self.root).as_posix()
            except ValueError:
                rel = None
            fedpar = rel is not None and rel.split("/")[0] in self.rooms and rel.endswith(".py") and "_pb2" not in rel
            self._files[filename] = rel if fedpar else None  # generated protobuf modules are not counted
        return self._files[filename]

    def __call__(self, frame, event, arg):
        if event == "call":
            rel = self.rel(frame.f_code.co_filename)
            if rel is not None:
                self._call(frame, (rel, frame.f_code.co_name), rel)
            return None
        if event == "return" and frame is not None:
            if frame is self.round_frame:
                self.in_round, self.round_frame = False, None
            if frame is self.upload_frame:
                self.in_upload, self.upload_frame = False, None
        if frame is None or not (self.in_round or self.in_upload):
            return None
        # code that runs without a call of its own, in a frame that may have been entered before the window opened:
        # the frame calls into C (c_call, c_return) or returns, and a return resumes its caller
        for running in (frame, frame.f_back) if event == "return" else (frame,):
            rel = self.rel(running.f_code.co_filename) if running is not None else None
            if rel is not None:
                self._note(running, rel, running.f_code.co_name)
        return None

    def _call(self, frame, mark: tuple[str, str], rel: str) -> None:
        m = self.marks
        if mark == m["round"] and not self.seen & {"round"}:
            self.seen.add("round")
            self.in_round = True
            if self.side == "agent":
                self.round_frame = frame
        elif mark in m.get("round_end", ()) and self.in_round:
            self.in_round = False
            self.seen.add("round_end")
        if mark in m["upload"] and "upload" not in self.seen:
            self.seen.add("upload")
            self.in_upload, self.upload_thread = True, threading.get_ident()
            if self.side == "agent":
                self.upload_frame = frame
        self._note(frame, rel, mark[1])
        if mark == m.get("upload_end") and self.in_upload:
            self.in_upload = False
            self.seen.add("upload_end")

    def _note(self, frame, rel: str, function: str) -> None:
        """``rel``'s code runs in ``frame`` now: count it in the windows that are open."""
        if self.in_round and not self._commands_loop():
            self.round.add(rel)
            self.functions["round"].add(f"{rel}:{function}")
        if self.in_upload and self._in_upload_window(frame):
            self.upload.add(rel)
            self.functions["upload"].add(f"{rel}:{function}")

    def _commands_loop(self) -> bool:
        """Whether this is the coordinator's main thread: `fedpar serve`'s wait loop (the live progress bar, the
        stop check), which polls twice a second from start to end whether or not a round or an upload runs, so
        that it fell in a window or not by timing. The coordinator and its workers run on threads of their own."""
        return self.side == "server" and threading.current_thread() is threading.main_thread()

    def _in_upload_window(self, frame) -> bool:
        """On the agent: the upload's thread; on the coordinator: anything but the command's wait loop and the
        round's own task."""
        if self.side == "agent":
            return threading.get_ident() == self.upload_thread
        if self._commands_loop():
            return False
        not_upload = self.marks["not_upload"]  # the round's own task: its loop and the round it awaits
        while frame is not None:
            if (self.rel(frame.f_code.co_filename), frame.f_code.co_name) in not_upload:
                return False
            frame = frame.f_back
        return True


def child(side: str, out: Path, argv: list[str]) -> int:
    """Run ``fedpar <argv>`` under a :class:`Tracer` and write what it saw to ``out``."""
    import fedpar.server
    from fedpar.cli.main import main

    tracer = Tracer(side, Path(fedpar.server.__file__).resolve().parent.parent)  # the fedpar this python runs
    threading.setprofile(tracer)
    sys.setprofile(tracer)
    code = 1
    try:
        code = main(argv) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        out.write_text(json.dumps({"side": side, "root": str(tracer.root), "exit": code, "seen": sorted(tracer.seen),
                                   "round": sorted(tracer.round), "upload": sorted(tracer.upload),
                                   "functions": {k: sorted(v) for k, v in tracer.functions.items()}}))
    return code


def measure(work: Path, timeout: float) -> dict:
    """Trace one round of `fedpar serve` and one `fedpar client`; their files, per side and together."""
    me = [sys.executable, str(Path(__file__).resolve()), "--child"]
    port_file = work / "port"
    # both on the CPU, where issue 26's counts were set: on a GPU box the round also ran the device's own code (31
    # files, 2026-11-29)
    serve = _traced(me, work, "server", ["serve", "--dataset", "digits", "--rounds", "1", "--clients-per-round", "1",
                                         "--min-available", "1", "--port", "0", "--port-file", str(port_file),
                                         "--out", str(work / "out"), "--insecure", "--device", "cpu"])
    agent = None
    try:
        end = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if serve.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"fedpar serve did not start listening:\n{_tail(work, 'server')}")
            time.sleep(0.1)
        agent = _traced(me, work, "agent", ["client", "--server", f"127.0.0.1:{port_file.read_text().strip()}",
                                            "--dataset", "digits", "--agent-id", "trace-0", "--insecure",
                                            "--device", "cpu"])
        for proc in (agent, serve):
            proc.wait(timeout=max(1.0, end - time.monotonic()))
    finally:
        for proc in (serve, agent):
            if proc is not None and proc.poll() is None:
                proc.kill()
    sides = {}
    for side in ("server", "agent"):
        if not (work / f"{side}.json").exists():
            raise RuntimeError(f"the traced {side} wrote nothing:\n{_tail(work, side)}")
        got = sides[side] = json.loads((work / f"{side}.json").read_text())
        wanted = {"round", "upload"} | ({"round_end", "upload_end"} if side == "server" else set())
        if got["exit"] != 0 or wanted - set(got["seen"]):
            raise RuntimeError(f"the {side} exited with {got['exit']} and saw markers {got['seen']} of "
                               f"{sorted(wanted)}: update MARKS in {Path(__file__).name} if the code moved\n"
                               f"{_tail(work, side)}")
    out = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores, Python "
                      f"{platform.python_version()})",
           "commit": _commit(Path(sides["server"]["root"]))}
    for window in ("round", "upload"):
        both = sorted(set(sides["server"][window]) | set(sides["agent"][window]))
        out[window] = {"files": len(both), "coordinator": sides["server"][window], "agent": sides["agent"][window],
                       "both": both, "functions": {"coordinator": sides["server"]["functions"][window],
                                                   "agent": sides["agent"]["functions"][window]}}
    return out


def _traced(me: list[str], work: Path, side: str, argv: list[str]) -> subprocess.Popen:
    """Start ``fedpar <argv>`` traced as ``side``; its output goes to WORK/<side>.log."""
    log = (work / f"{side}.log").open("wb")
    return subprocess.Popen(me + [side, str(work / f"{side}.json"), "--", *argv], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)


def _tail(work: Path, side: str, lines: int = 20) -> str:
    """The last lines a traced process wrote."""
    path = work / f"{side}.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _commit(root: Path) -> str:
    """The commit of the checkout at ``root`` (the fedpar traced)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Trace a round, print the figures and file lists, write the JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], Path(argv[2]), argv[4:])
    p = FedparParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=RESULTS / "trace_round.json", help="where the figures go")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the round may take in all")
    p.add_argument("--round-target", type=int, default=30, help="files one round may run code in (issue 26)")
    p.add_argument("--upload-target", type=int, default=8, help="files one upload may cross (issue 26)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedpar-trace-") as tmp:
        try:
            figures = measure(Path(tmp), args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"trace_round: {exc}", file=sys.stderr)
            return 1
    figures["targets"] = {"round": args.round_target, "upload": args.upload_target}
    ratios = [{"what": f"files one traced round runs code in: {figures['round']['files']}",
               "ratio": figures["round"]["files"] / args.round_target,
               "against": f"issue 26's target of {args.round_target} files (at most 1.00x)"},
              {"what": f"files one upload crosses: {figures['upload']['files']}",
               "ratio": figures["upload"]["files"] / args.upload_target,
               "against": f"issue 26's target of {args.upload_target} files (at most 1.00x)"}]
    write_results(args.json, ratios, figures, argv=[sys.argv[0], *argv])
    print(f"{figures['date']}, {figures['machine']}, commit {figures['commit']}")
    for window, target in (("round", args.round_target), ("upload", args.upload_target)):
        got = figures[window]
        print(f"{window}: {got['files']} files (target {target}; coordinator {len(got['coordinator'])}, agent "
              f"{len(got['agent'])})")
        for rel in got["both"]:
            where = "+".join(s for s, k in (("coordinator", "coordinator"), ("agent", "agent")) if rel in got[k])
            print(f"  {rel}  [{where}]")
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
