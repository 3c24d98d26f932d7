"""Everything composes: every pair of `fedpar simulate`'s features runs and learns, except the pairs that are
impossible on mathematical grounds, which are refused with their line of the table (aggregation/compatibility.py,
shown in docs/explanation/composition.md).

Pairwise coverage: the cases are an all-pairs covering array over the factors of tests/support/composition.py
(every allowed pair of levels is in some case that runs; every refused pair is a case of its own, the other factors
at their first level), not their full product. Each case is a couple of rounds of a tiny federation, run by the
command line in this process: half of the runs here, the other half in tests/test_composition_runs.py (two files,
so the two test workers share them).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from fedpar.aggregation.compatibility import CLASHES, markdown_table
from fedpar.cli.main import main
from support.composition import (FACTORS, REFUSALS, RUNS, allowed, case_id, flags, half_of_the_runs, refused,
                                 runs_and_learns, skip_without_flower)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "explanation" / "composition.md"


def test_the_cover_has_every_allowed_pair_and_each_refused_pair_once():
    for f, g in itertools.combinations(FACTORS, 2):
        for a, b in itertools.product(FACTORS[f], FACTORS[g]):
            if allowed({f: a, g: b}):
                assert any(c[f] == a and c[g] == b for c in RUNS), (f, a, g, b)
    assert all(refused(c) is not None for c in REFUSALS)
    assert all(allowed(c) for c in RUNS)
    assert len(RUNS) < 40  # pairwise, not the product of the levels (8 x 3 x 2^7 = 3072)
    halves = half_of_the_runs(0) + half_of_the_runs(1)  # the two files run every case of the cover once
    assert sorted(map(case_id, halves)) == sorted(map(case_id, RUNS))


def _built(page: str) -> str:
    """``page`` as the site shows it: its lists of strategies filled in (docs/hooks/strategy_lists.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("strategy_lists", ROOT / "docs" / "hooks" / "strategy_lists.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook.on_page_markdown(page, None, None, None)


def test_the_docs_show_the_table_the_refusals_come_from():
    """As built: the page names the robust strategies by the hook's list, so that a new one needs no edit of it (it
    listed them by hand, and a new strategy failed this test)."""
    assert "(<!-- robust strategies -->)" in DOC.read_text()
    assert markdown_table() in _built(DOC.read_text())


@pytest.mark.parametrize("case", half_of_the_runs(0), ids=case_id)
def test_an_allowed_combination_runs_and_learns(case, tmp_path):
    runs_and_learns(case, tmp_path)


def _documented_reasons() -> list[str]:
    return [row.split(" | ")[-1].rstrip(" |") for row in DOC.read_text().splitlines()
            if row.startswith("| ") and row.count(" | ") == 2]


@pytest.mark.parametrize("case", REFUSALS, ids=case_id)
def test_a_refused_combination_says_why_in_the_documented_line(case, tmp_path, capsys):
    skip_without_flower(case)
    assert main(flags(case, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    line = err.removeprefix("fedpar simulate: ").rstrip("\n")
    assert line == refused(case)
    reason = re.sub(r"^.*? cannot run with .*?: ", "", line).split("; use a linear strategy: ")[0]  # what works
    assert reason in _documented_reasons() and reason in {c.reason for c in CLASHES}
