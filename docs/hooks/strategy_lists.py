"""MkDocs hook: the lists of strategies in the docs' prose, generated while the site builds from the registry
(aggregation/catalog.py), so that a new strategy appears in every list it belongs to with no edit of a page."""

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


def on_page_markdown(markdown, page, config, files):
    """Put each list where a page asks for it."""
    for marker in MARKERS:
        if marker in markdown:
            markdown = markdown.replace(marker, strategy_list(marker))
    return markdown
