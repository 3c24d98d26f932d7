"""A ServerApp-driven ``fedpar simulate --flower-app`` (no ``--strategy``) whose ClientApp cannot be loaded: the
mistake is said once, in one line, before any worker starts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from support.in_process import run_main  # noqa: E402

APP = Path(__file__).parent / "tiny_app"


def _broken(tmp_path: Path, clientapp: str | None = None, last_line: str | None = None) -> Path:
    """A copy of the tiny app whose clientapp reference is ``clientapp``, or whose client module ends with
    ``last_line``."""
    app = tmp_path / "app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    if clientapp is not None:
        project = app / "pyproject.toml"
        project.write_text(project.read_text().replace('"tiny_flower_app.client_app:app"', repr(clientapp)))
    if last_line is not None:
        module = app / "tiny_flower_app" / "client_app.py"
        module.write_text(f"{module.read_text()}\n{last_line}\n")
    return app


@pytest.mark.parametrize("clientapp, last_line, said", [
    ("tiny_flower_app.client_app:nope", None, "Unable to load attribute nope from module tiny_flower_app.client_app"),
    (None, "import a_module_this_app_lacks", "failed: ModuleNotFoundError: No module named 'a_module_this_app_lacks'"),
], ids=["missing-component", "missing-import"])
def test_a_client_app_that_cannot_load_stops_in_one_line_before_the_workers(tmp_path, capfd, clientapp, last_line,
                                                                            said):
    """Each worker printed the loader's traceback and the run ended 'worker process fedpar-worker-0 died with exit
    code 1', exit 1 (QA); the route with --strategy said it in one line, exit 2."""
    app = _broken(tmp_path, clientapp, last_line)
    done = run_main(["simulate", "--flower-app", str(app), "--clients", "2", "--workers", "1",
                     "--out", str(tmp_path / "out")], capfd)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith(f"fedpar simulate: {app.resolve()}: ") and said in lines[-1], done.stderr[-3000:]
    assert "worker process" not in done.stderr and not (tmp_path / "out" / "metrics.jsonl").exists()
