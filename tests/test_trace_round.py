"""benchmarks/trace_round.py counts fedpar's own source files only, and counts a file whenever its code runs in a
window, also from a frame entered before the window opened."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[1]


def _tracer(side: str = "agent"):
    spec = importlib.util.spec_from_file_location("trace_round", ROOT / "benchmarks" / "trace_round.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Tracer(side, ROOT)


def _frame_of(rel: str):
    """A live frame whose code belongs to ``rel`` (as the profiler sees code of that file)."""
    scope: dict = {"sys": sys}
    exec(compile("frame = sys._getframe()", str(ROOT / rel), "exec"), scope)
    return scope["frame"]


def test_only_the_rooms_source_files_count():
    tracer = _tracer()
    assert tracer.rel(str(ROOT / "client" / "runtime.py")) == "client/runtime.py"
    assert tracer.rel(str(ROOT / "server" / "ranks" / "plane.py")) == "server/ranks/plane.py"
    for other in (ROOT / "protocol" / "fedpar_pb2.py", ROOT / "benchmarks" / "trace_round.py",
                  ROOT / "tests" / "support" / "processes.py", ROOT / ".venv" / "lib" / "grpc" / "__init__.py",
                  Path(numpy.__file__), ROOT / "README.md"):
        assert tracer.rel(str(other)) is None, other


def test_a_frame_entered_before_the_window_counts_when_its_code_runs_in_it():
    tracer = _tracer()
    waiting = _frame_of("cli/serve.py")  # e.g. a loop that polls from before the round began
    tracer(waiting, "c_call", None)
    assert tracer.round == set()  # no window open yet
    tracer.in_round = True
    tracer(waiting, "c_call", None)  # it calls into C (a wait) during the round
    assert tracer.round == {"cli/serve.py"}
    tracer(_frame_of("server/app.py"), "return", None)  # a frame returns: its code ran (its caller is this test)
    assert tracer.round == {"cli/serve.py", "server/app.py"}
    assert tracer.functions["round"] == {"cli/serve.py:<module>", "server/app.py:<module>"}
    tracer(_frame_of("server/rounds.py"), "call", None)  # a call in the window
    assert "server/rounds.py" in tracer.round


def test_the_coordinators_upload_window_leaves_out_the_main_threads_wait_loop():
    tracer = _tracer("server")
    tracer.in_upload = True
    tracer(_frame_of("cli/progress.py"), "c_call", None)  # the command's wait loop polls on the main thread
    assert tracer.upload == set()
    worker = threading.Thread(target=lambda: tracer(_frame_of("server/uploads.py"), "c_call", None))
    worker.start()
    worker.join()
    assert tracer.upload == {"server/uploads.py"}  # the coordinator's own threads count


def test_the_coordinators_round_window_leaves_out_the_main_threads_wait_loop():
    tracer = _tracer("server")
    tracer.in_round = True
    tracer(_frame_of("cli/serve_once.py"), "c_call", None)  # serve's wait loop polls the progress bar meanwhile
    assert tracer.round == set()
    worker = threading.Thread(target=lambda: tracer(_frame_of("cli/progress.py"), "c_call", None))
    worker.start()  # the round's own row, printed on the coordinator's thread, counts
    worker.join()
    assert tracer.round == {"cli/progress.py"}
    agent = _tracer("agent")  # an agent runs its round on its main thread
    agent.in_round = True
    agent(_frame_of("client/runtime.py"), "c_call", None)
    assert agent.round == {"client/runtime.py"}


def test_a_traced_round_runs_code_in_at_most_30_files_and_an_upload_crosses_no_more_than_it_did(tmp_path):
    # issue 26's round target (met), and the upload's count when last measured (11; its target is 8): a file that
    # joins either is seen here, not in the next session's trace (a per-round callback of serve's once made it 32)
    import json
    import subprocess

    def traced(attempt: int) -> dict:
        out = tmp_path / f"trace{attempt}.json"
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_round.py"), "--json", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(out.read_text())["results"]

    # A loaded machine's trace once counted a 31st file that the same code's other traces never showed (a callback
    # that fell in the window by timing): a file over the count must be in a second trace too, as code that joined
    # the round or the upload is in every trace.
    first = traced(1)
    for window, most in (("round", 30), ("upload", 11)):
        files = set(first[window]["both"])
        if len(files) > most:
            again = traced(2)[window]
            files &= set(again["both"])
            extra = sorted(set(first[window]["both"]) ^ set(again["both"]))
            print(f"{window}: the two traces differ in {extra}")
        assert len(files) <= most, (window, sorted(files), first[window]["functions"])
