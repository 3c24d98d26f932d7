"""Flower's own console log lines (flwr's coloured handler) reach a stderr that is no terminal without ANSI colour
codes: those of the coordinator's ServerApp and those of the worker processes that host the ClientApps."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

APP = Path(__file__).parent / "tiny_app"
ROOT = Path(__file__).parents[2]


def _logging_app(tmp_path: Path) -> Path:
    """The tiny app, its ClientApp logging one INFO line through Flower's logger as it trains (and its initial
    arrays named, for --strategy)."""
    app = tmp_path / "app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    client = app / "tiny_flower_app" / "client_app.py"
    text = client.read_text()
    text = text.replace("app = ClientApp()", "from logging import INFO\nfrom flwr.common.logger import log\n\n"
                                              "app = ClientApp()")
    text = text.replace('    partition_id = int(context.node_config["partition-id"])\n',
                        '    partition_id = int(context.node_config["partition-id"])\n'
                        '    log(INFO, "member %d trains", partition_id)\n', 1)
    client.write_text(text)
    (app / "tiny_flower_app" / "fedpar_parts.py").write_text(
        "from flwr.app import Array, ArrayRecord\nfrom tiny_flower_app.task import initial_arrays\n\n\n"
        "def model():\n    return ArrayRecord({name: Array(a) for name, a in initial_arrays().items()})\n")
    with (app / "pyproject.toml").open("a") as f:  # what --strategy needs: the initial arrays
        f.write('\n[tool.fedpar]\nmodel = "tiny_flower_app.fedpar_parts:model"\n')
    return app


@pytest.mark.parametrize("driver", [[], ["--strategy", "fedavg", "--rounds", "1"]])
def test_flower_log_lines_carry_no_colour_codes_into_a_file_or_pipe(tmp_path, driver):
    """69 escape sequences reached a redirected stderr (e.g. '\\x1b[92mINFO \\x1b[0m:  Starting FedAvg strategy')."""
    done = subprocess.run([sys.executable, "-m", "fedpar", "simulate", "--flower-app", str(_logging_app(tmp_path)),
                           "--clients", "2", "--workers", "1", "--run-config", "num-server-rounds=1", *driver,
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "member 0 trains" in done.stderr and "member 1 trains" in done.stderr, done.stderr[-3000:]  # the workers'
    if not driver:  # the ServerApp's own strategy logs on the coordinator
        assert "INFO :      Starting FedAvg strategy" in done.stderr, done.stderr[-3000:]
    assert "\x1b" not in done.stderr, [line for line in done.stderr.splitlines() if "\x1b" in line][:5]


def test_flower_keeps_its_colours_on_a_terminal_unless_no_color_is_set(monkeypatch):
    import os
    import pty

    from flwr.common.logger import console_handler

    from fedpar.tasks.flower_app import plain_flower_logs

    main_fd, terminal_fd = pty.openpty()
    stream, colored = console_handler.stream, console_handler.colored
    try:
        with open(terminal_fd, "w") as terminal, open(os.devnull, "w") as file:
            monkeypatch.delenv("NO_COLOR", raising=False)
            console_handler.setStream(terminal)
            plain_flower_logs()
            assert console_handler.colored is True
            monkeypatch.setenv("NO_COLOR", "1")  # https://no-color.org
            plain_flower_logs()
            assert console_handler.colored is False
            monkeypatch.delenv("NO_COLOR")
            console_handler.setStream(file)
            plain_flower_logs()
            assert console_handler.colored is False
    finally:
        console_handler.stream = stream  # setStream would flush the closed one
        console_handler.colored = colored
        os.close(main_fd)


def test_quiet_keeps_flower_s_lines_out_of_every_process(tmp_path):
    """--quiet ("print only the summary") printed Flower's 40-odd INFO lines: the ServerApp's strategy on the
    coordinator and the ClientApps' own lines in the workers."""
    done = subprocess.run([sys.executable, "-m", "fedpar", "simulate", "--flower-app", str(_logging_app(tmp_path)),
                           "--clients", "2", "--workers", "1", "--run-config", "num-server-rounds=1", "--quiet",
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "INFO" not in done.stderr and "member 0 trains" not in done.stderr, done.stderr[-3000:]
    assert '"rounds"' in done.stdout  # the summary
