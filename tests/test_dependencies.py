"""The rooms import one way only (docs/explanation/architecture.md, "Layout"): checked on the source, import by
import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = {"protocol", "models", "datasets", "security"}
ALLOWED = {
    "protocol": set(), "models": set(), "datasets": set(),
    "security": {"protocol"},  # files written with protocol/atomicfile.py
    "secagg": {"protocol"},
    "aggregation": {"protocol", "models"},
    "parallel": {"protocol", "models", "datasets"},
    "tasks": {"protocol", "models", "datasets", "parallel"},  # running a fedpar.Task: its data, evaluation, the zoo
    "server": BASE | {"secagg", "aggregation", "parallel", "tasks"},  # aggregator ranks join a gloo group
    "client": BASE | {"secagg", "aggregation", "parallel", "tasks"},  # large-model agents train on the engine
}
PACKAGE_ROOT = {"settings", "ranges", "sections", "task", "discovery", "meant", "wording", "ports"}  # settings.py,
# ranges.py (the declared ranges), sections.py, task.py (the public Task), discovery.py (finding the strategies and
# datasets of a package), meant.py (the one "did you mean"), wording.py (how a line says a count), ports.py (a port
# held for a listener that starts later): every room may import them


def _imported_rooms(folder: Path) -> dict[str, str]:
    """Room imported -> a file that imports it, for every ``fedpar.X`` import under ``folder``."""
    found: dict[str, str] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "fedpar" and len(parts) > 1 and parts[1] in PACKAGE_ROOT:
                    continue
                if parts[0] == "fedpar" and len(parts) > 1:
                    found.setdefault(parts[1], str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_room_imports_only_the_rooms_below_it(room):
    bad = {dep: where for dep, where in _imported_rooms(ROOT / room).items()
           if dep != room and dep not in ALLOWED[room]}
    assert not bad, (f"{room}/ must not import {sorted(bad)} (e.g. {next(iter(bad.values()))}); "
                     "see docs/explanation/architecture.md")
