"""The console script (cli/entry.py): a Ctrl-C while the command's modules load ends it with one line and 130."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.processes import interrupted_import

# SIGINT arrives exactly while MODULE is imported, as a user's Ctrl-C in the first half second of a command does
INTERRUPTED_IMPORT = interrupted_import(["simulate", "--clients", "2", "--rounds", "1"])


@pytest.mark.parametrize("module", ["fedpar.cli.main", "fedpar.cli.simulate"])
def test_ctrl_c_while_the_command_loads_is_one_line_and_130(module, tmp_path):
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, module], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == "fedpar simulate: interrupted"


def test_torchs_info_lines_are_not_said_at_fedpars_info_level(caplog):
    # a Ctrl-C while torch was still importing printed its exit hook's "FakeTensor cache stats" after 'interrupted'
    import logging

    from fedpar.cli.log_level import setup_logging

    setup_logging({"log_level": "info"})
    with caplog.at_level(logging.NOTSET):
        logging.getLogger("torch._subclasses.fake_tensor").info("FakeTensor cache stats:")
        logging.getLogger("torch").warning("a warning still shows")
    said = [r.getMessage() for r in caplog.records]
    assert "FakeTensor cache stats:" not in said and "a warning still shows" in said
