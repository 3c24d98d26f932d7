"""`fedpar serve --state S` in a folder the service cannot write (read-only for its user, or a system folder): it said
'state file S cannot be locked: S.lock is not a file this service can use (Permission denied); move it aside, or
give another --state', though there was nothing to move aside. It now says the folder cannot be written. serve's
main in this process (it refuses before it listens)."""

from __future__ import annotations

from fedpar.security.certs import ensure_certs
from support.in_process import run_main


def test_a_state_file_in_a_folder_that_cannot_be_written_is_said_as_such(tmp_path, capfd):
    certs = tmp_path / "certs"
    ensure_certs(certs, operators=["op"])
    for state, why in (("/sys/state.db", "Permission denied"), ("/proc/state.db", "No such file or directory")):
        done = run_main(["serve", "--state", state, "--certs", str(certs), "--port", "0", "--control-port", "0"],
                        capfd)
        lines = [line for line in done.stderr.splitlines() if "fedpar.security" not in line]
        assert done.returncode == 2 and "Traceback" not in done.stderr, done
        folder = state.rsplit("/", 1)[0]
        assert lines == [f"fedpar serve: state file {state} cannot be locked: its folder {folder} cannot be written "
                         f"({why}); give --state a path in a folder this user can write"], done.stderr
    lock = tmp_path / "state.db.lock"  # a lock file's place taken by a folder: that one is to move aside
    lock.mkdir()
    done = run_main(["serve", "--state", str(tmp_path / "state.db"), "--certs", str(certs), "--port", "0",
                     "--control-port", "0"], capfd)
    assert done.returncode == 2 and "move it aside" in done.stderr, done
