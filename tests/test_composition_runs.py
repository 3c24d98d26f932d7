"""The other half of the pairwise cover's runs of tests/test_composition.py (each a couple of rounds of a tiny
federation by the command line in this process, which must run and learn): a file of its own, so that pytest-xdist's
two workers run the two halves side by side."""

from __future__ import annotations

import pytest

from support.composition import case_id, half_of_the_runs, runs_and_learns


@pytest.mark.parametrize("case", half_of_the_runs(1), ids=case_id)
def test_an_allowed_combination_runs_and_learns(case, tmp_path):
    runs_and_learns(case, tmp_path)
