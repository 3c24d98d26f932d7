"""`fedpar run get ID --out DIR` into a folder that cannot be written or made: it asked the service for the run's
files first and then failed as it wrote the first one, exit 1, with 'Permission denied: global.safetensors.part in
folder DIR; check the permissions, or pick another path (--debug shows the traceback)' (or 'No such file or
directory: x in folder /proc'). It is now refused before anything is asked, in one line saying to give a folder this
user can write, exit 2, as export's --to is. A real control API over a run store, the command's main in this
process."""

from __future__ import annotations

import numpy
import safetensors.numpy

from support.control_api import control_api
from support.in_process import run_main


def test_get_into_a_folder_that_cannot_be_written_is_refused_before_the_download(tmp_path, capfd):
    with control_api(tmp_path) as (store, options, _, _):
        run_id = store.submit("done", {"rounds": 1}, who="op")
        folder = tmp_path / "run"
        folder.mkdir()
        store.start(run_id, str(folder))
        (folder / "global.safetensors").write_bytes(safetensors.numpy.save({"w": numpy.ones(3, numpy.float32)}))
        store.end(run_id, "finished", "", str(folder / "global.safetensors"))
        for out, line in (("/proc", "--out /proc: cannot write in the folder: No such file or directory; give a "
                                    "folder this user can write"),
                          ("/proc/x", "--out /proc/x: cannot make the folder: No such file or directory; give a "
                                      "folder this user can make, or one that exists")):
            done = run_main(["run", "get", str(run_id), "--out", out, *options], capfd)
            assert done.returncode == 2 and done.stdout == "", done
            assert done.stderr.splitlines() == [f"fedpar run: {line}"], done.stderr
        assert "get" not in [row["action"] for row in store.audit_rows()]  # nothing was asked of the service
        done = run_main(["run", "get", str(run_id), "--out", str(tmp_path / "got"), *options], capfd)
        assert done.returncode == 0 and (tmp_path / "got" / "global.safetensors").is_file(), done
