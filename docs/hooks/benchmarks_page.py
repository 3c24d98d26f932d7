"""MkDocs hook: the benchmarks page's tables, generated while the site builds from the JSON the benchmarks write
(benchmarks/results/*.json, written by benchmarks/results.py: date, machine, command, ratios)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MARKER = "<!-- benchmark results -->"


def results_markdown(folder: Path = RESULTS) -> str:
    """One section per results file, newest first: when, where, the command, and its ratios."""
    runs = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    if not runs:
        return "No results are committed yet: run a benchmark with `--json benchmarks/results/NAME.json`.\n"
    lines = []
    for run in sorted(runs, key=lambda r: (r["date"], r["benchmark"]), reverse=True):
        lines += [f"### {run['benchmark']}", "", f"- date: {run['date']}", f"- machine: {run['machine']}",
                  f"- command: `{run['command']}`"]
        if "--quick" in run["command"].split():  # committed before --quick runs were kept out of results/
            lines.append("- a smoke run (`--quick`, small sizes): its ratios are not the full benchmark's")
        lines += ["", "| what | ratio | against |", "|---|---|---|"]
        lines += [f"| {r['what']} | {r['ratio']:.2f}x | {r['against']} |" for r in run["ratios"]]
        lines.append("")
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    """Put the results where the benchmarks page asks for them."""
    if MARKER in markdown:
        return markdown.replace(MARKER, results_markdown())
    return markdown
