"""cli/leaving.py: a command's process ends once its threads and every exit handler are done, without the
interpreter's teardown of its modules, and with the command's code."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A process as the console script runs one: arrange() first, then modules that add exit handlers, then leave().
SCRIPT = textwrap.dedent("""
    import sys
    from fedpar.cli.leaving import arrange, leave

    arrange()
    import atexit, logging, threading, time

    class SaysWhenTornDown:
        def __del__(self):
            sys.stdout.write("torn down\\n")

    kept = SaysWhenTornDown()  # a module global: the interpreter's teardown would delete it
    logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
    logging.getLogger("x").info("logged before the exit")  # written by logging's own exit handler's flush
    atexit.register(lambda: print("an exit handler ran"))
    threading.Thread(target=lambda: (time.sleep(0.3), print("a thread finished"))).start()
    print("buffered, not flushed", end="")
    if sys.argv[1] == "raise":
        raise RuntimeError("escaped")
    leave(int(sys.argv[1]))
""")


@pytest.mark.parametrize("code", [0, 3])
def test_leave_runs_the_threads_and_exit_handlers_then_skips_the_teardown(code, tmp_path):
    log = tmp_path / "log.txt"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(code), str(log)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == code, done.stderr
    assert done.stdout == "buffered, not flusheda thread finished\nan exit handler ran\n", done.stdout
    assert "logged before the exit" in log.read_text()
    assert done.stderr == ""


def test_a_command_that_did_not_return_exits_as_python_does(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, "raise", str(tmp_path / "log.txt")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert "RuntimeError: escaped" in done.stderr
    assert "torn down" in done.stdout  # the interpreter's own teardown, as without leaving.py


@pytest.mark.parametrize("module", ["fedpar", "fedpar.cli.main"])
def test_both_module_routes_keep_the_commands_exit_code_and_output(module, tmp_path):
    done = subprocess.run([sys.executable, "-m", module, "certs", "--out", str(tmp_path / "c"), "--agents", "a"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines()[-1].startswith("next: fedpar serve"), done
    refused = subprocess.run([sys.executable, "-m", module, "serve", "--rounds", "0"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
