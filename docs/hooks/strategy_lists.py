"""MkDocs hook: the lists of strategies in the docs' prose, and the Python API page's entries of the strategies,
generated while the site builds from the registry (aggregation/catalog.py), so that a new strategy appears in every
list it belongs to with no edit of a page."""

from __future__ import annotations

MARKERS = {
    "<!-- strategies -->": "strategy_names",  # every built-in strategy
    "<!-- linear strategies -->": "linear_strategy_names",  # what secure aggregation and aggregator ranks sum
    "<!-- robust strategies -->": "robust_strategies",  # the rest: their rule needs each update
}


def strategy_list(marker: str) -> str:
    """The names ``marker`` stands for, comma-separated, in the registry's order."""
    from fedpar.aggregation import compatibility, registry

    kind = MARKERS[marker]
    names = getattr(registry if kind == "strategy_names" else compatibility, kind)()
    return ", ".join(names)


REFERENCE = "<!-- strategy reference -->"  # the API page: a mkdocstrings entry per registered strategy


def api_identifier(cls: type) -> str:
    """The identifier the API page documents strategy class ``cls`` under: fedpar.aggregation is read from the
    aggregation/ folder (mkdocs.yml's ``paths: [.]``), so ``fedpar.aggregation.robust.Krum`` is
    ``aggregation.robust.Krum``."""
    return f"{cls.__module__.removeprefix('fedpar.')}.{cls.__qualname__}"


def strategy_reference() -> str:
    """A ``:::`` entry for each registered strategy, in the registry's order, after a line with its ``--strategy``
    name and the options its constructor takes from the command line and ``build_strategy`` (with their aliases:
    what ``--help`` lists), so that those show even where the class inherits its constructor."""
    from fedpar.aggregation.catalog import strategy_classes
    from fedpar.aggregation.options import option_specs

    entries = []
    for name, cls in strategy_classes().items():
        specs = option_specs(cls).values()
        options = "; ".join(f"`{s.name}`" + (f" (alias `{'`, `'.join(s.aliases)}`)" if s.aliases else "")
                            + f": {s.type.__name__}, default `{s.default!r}`" for s in specs) or "none"
        entries.append(f"`--strategy {name}`, `build_strategy(\"{name}\", ...)`; options: {options}.\n\n"
                       f"::: {api_identifier(cls)}")
    return "\n\n".join(entries)


def on_page_markdown(markdown, page, config, files):
    """Put each list where a page asks for it."""
    for marker in MARKERS:
        if marker in markdown:
            markdown = markdown.replace(marker, strategy_list(marker))
    if REFERENCE in markdown:
        markdown = markdown.replace(REFERENCE, strategy_reference())
    return markdown
