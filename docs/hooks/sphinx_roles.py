"""Griffe extension (mkdocs.yml, mkdocstrings' python handler): the Sphinx roles of fedpar's docstrings
(``:class:`ClientData```, ``:meth:`~Strategy.fold```, ``:func:`fedpar.tasks.share_of```) rendered as mkdocstrings
renders its own: a cross-reference to the object where the site documents it, its name as code where it does not.

The docstrings keep their Sphinx roles (``docstring_style: sphinx``, and what IDEs show); only the text the Python
API page renders is rewritten, as the docs build reads it. A role's target is resolved in the scope of the object
whose docstring holds it; ``fedpar.ROOM.x`` is documented as ``ROOM.x`` (the rooms are folders at the repository
root, read from there: mkdocs.yml's ``paths: [.]``)."""

from __future__ import annotations

import html
import importlib
import re
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|mod|exc|data|obj|const|type):`(~?)([\w.]+)(?:\(\))?`")


def defined_at(path: str) -> str:
    """Where the object at ``path`` is defined: ``fedpar.tasks.share_of`` (a re-export) is
    ``fedpar.tasks.data.share_of``; ``path`` itself when it is not an importable fedpar class or function."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return path
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        return f"{module}.{qualname}" if module and qualname and module.startswith("fedpar.") else path
    return path


def site_identifier(path: str) -> str:
    """The identifier the site documents ``path`` under: ``fedpar.aggregation.x`` as ``aggregation.x`` (a room, a
    folder of the repository root installed as ``fedpar.ROOM``); fedpar/'s own modules keep ``fedpar.``."""
    if path.startswith("fedpar."):
        path = defined_at(path)
    parts = path.split(".")
    if len(parts) > 2 and parts[0] == "fedpar" and not (ROOT / "fedpar" / parts[1]).exists() \
            and not (ROOT / "fedpar" / f"{parts[1]}.py").exists() and (ROOT / parts[1]).is_dir():
        return ".".join(parts[1:])
    return path


def _resolved(obj: griffe.Object, target: str) -> str | None:
    """The full path of ``target`` as seen from ``obj`` (its scope, its class's, its module's), or None."""
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            return scope.resolve(target)
        except (griffe.NameResolutionError, AttributeError, KeyError, ValueError):
            pass
        head, _, rest = target.partition(".")
        member = scope.members.get(head) if hasattr(scope, "members") else None
        if member is not None:
            path = member.target_path if member.is_alias else member.path  # an import: where it comes from
            return f"{path}.{rest}" if rest else path
        scope = scope.parent
    return target if "." in target else None  # a full path as written (fedpar.tasks.share_of)


def rewritten(text: str, obj: griffe.Object) -> str:
    """``text`` with each Sphinx role replaced: an optional cross-reference (plain code when the site does not
    document its target: autorefs leaves the title alone then)."""

    def replace(match: re.Match) -> str:
        _, tilde, target = match.groups()
        title = target.rsplit(".", 1)[-1] if tilde else target
        path = _resolved(obj, target)
        code = f"<code>{html.escape(title)}</code>"
        if path is None:
            return code
        return f'<autoref identifier="{html.escape(site_identifier(path))}" optional>{code}</autoref>'

    return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring once the object tree is complete (names resolve then)."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = rewritten(obj.docstring.value, obj)
