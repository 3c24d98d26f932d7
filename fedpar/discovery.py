"""Finding a package's plug-in modules: those that declare an entry with a given decorator, imported on first use.

A strategy (``@register_strategy``, aggregation/catalog.py) or a dataset (``@register_dataset``,
datasets/catalog.py) is one module in its package and its test: nothing lists it. A module declares its entries by
decorating them, and only the modules whose source has a line starting with that decorator are imported, so that
finding them imports no module that has nothing to offer (e.g. the ones that need Flower).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re


def import_declaring(package: str, decorator: str) -> list[str]:
    """Import every module of ``package`` whose source has a line starting with ``@decorator``; their names, sorted."""
    pattern = re.compile(rf"^@{re.escape(decorator)}\b", re.MULTILINE)
    path = importlib.import_module(package).__path__
    found = []
    for module in sorted(m.name for m in pkgutil.iter_modules(path) if not m.ispkg):
        name = f"{package}.{module}"
        spec = importlib.util.find_spec(name)
        source = spec.loader.get_source(name) if spec is not None and hasattr(spec.loader, "get_source") else None
        if source is None or pattern.search(source):  # no source to read (a compiled install): import it to see
            importlib.import_module(name)
            found.append(name)
    return found
