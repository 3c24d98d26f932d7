"""Everything composes: every pair of `fedpar simulate`'s features runs and learns, except the pairs that are
impossible on mathematical grounds, which are refused with their line of the table (aggregation/compatibility.py,
shown in docs/explanation/composition.md).

Pairwise coverage: the cases are an all-pairs covering array over the factors below (every allowed pair of levels
is in some case that runs; every refused pair is a case of its own, the other factors at their first level), not
their full product. Each case is a couple of rounds of a tiny federation, run by the command line in this process.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest

from fedpar.aggregation.compatibility import CLASHES, composition_features, markdown_table, refusal
from fedpar.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "explanation" / "composition.md"
TASK = ["--task", "examples/own_task.py:task", "--task-option", f"csv={ROOT / 'examples' / 'table.csv'}"]
CLIENTS = 4
# Each factor's levels, the first being "off"; a level is the flags it adds.
FACTORS: dict[str, dict[str, list[str]]] = {
    "strategy": {"fedavg": [], "fedprox": ["--strategy", "fedprox", "--strategy-option", "mu=0.01"],
                 "fedadam": ["--strategy", "fedadam", "--strategy-option", "eta=0.03"],
                 "median": ["--strategy", "median"], "trimmed_mean": ["--strategy", "trimmed_mean"],
                 "krum": ["--strategy", "krum"], "flower": ["--strategy", "flower:flwr.server.strategy:FedAvg"]},
    "tls": {"off": [], "on": ["--tls"]},
    "secagg": {"off": [], "on": ["--secure-aggregation", "--secagg-clip", "0.5"]},
    "dp": {"none": [], "central": ["--privacy", "central", "--privacy-noise", "0.01", "--privacy-clip", "5"],
           "client": ["--privacy", "client", "--privacy-noise", "0.01", "--privacy-clip", "5"]},
    "compression": {"off": [], "on": ["--compression", "int8"]},
    "batching": {"off": ["--client-batching", "off"], "on": ["--client-batching"]},
    "clock": {"off": [], "on": ["--clock", "virtual", "--trace", "{trace}"]},
    "ranks": {"1": [], "2": ["--aggregator-ranks", "2"]},
    "task": {"off": [], "on": TASK},
}
# Pairs not yet composed, with where the work is (not mathematical: none is in the table).
PENDING: dict[frozenset, str] = {}


def _features(case: dict[str, str]) -> dict[str, str]:
    """The table's features a case turns on, named as `fedpar simulate` names them."""
    strategy = case["strategy"]
    name = FACTORS["strategy"][strategy][1] if FACTORS["strategy"][strategy] else "fedavg"
    return composition_features(f"dp-{name}" if case["dp"] != "none" else name, case["secagg"] == "on",
                                "int8" if case["compression"] == "on" else "none")


def _refused(case: dict[str, str]) -> str | None:
    return refusal(_features(case))


def _allowed(case: dict[str, str]) -> bool:
    """Whether a (partial) case runs: no refused pair in it, and no pending one."""
    full = {f: case.get(f, next(iter(levels))) for f, levels in FACTORS.items()}
    pairs = {frozenset(p) for p in itertools.combinations(case.items(), 2)}
    return _refused(full) is None and not pairs & PENDING.keys()


def covering_cases(tries: int = 100) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """An all-pairs covering array of the allowed cases, and one case per refused pair of levels. Greedy: each case
    starts from an uncovered pair and adds, factor by factor, the level that covers most uncovered pairs; of
    ``tries`` seeded orders the cheapest cover is kept (two aggregator ranks cost about a case more)."""
    names = list(FACTORS)
    first = {f: next(iter(FACTORS[f])) for f in names}
    pairs, refused = [], []
    for f, g in itertools.combinations(names, 2):
        for a, b in itertools.product(FACTORS[f], FACTORS[g]):
            pair = {f: a, g: b}
            if _allowed(pair):
                pairs.append(pair)
            elif frozenset(pair.items()) not in PENDING:
                refused.append({**first, **pair})
    covers = [_greedy_cover(pairs, random.Random(seed)) for seed in range(tries)]
    return min(covers, key=lambda cases: len(cases) + sum(c["ranks"] == "2" for c in cases)), refused


def _greedy_cover(pairs: list[dict[str, str]], rng: random.Random) -> list[dict[str, str]]:
    uncovered = rng.sample(pairs, len(pairs))
    cases = []
    while uncovered:
        case = dict(uncovered[0])
        for f in rng.sample(list(FACTORS), len(FACTORS)):
            if f in case:
                continue
            options = [v for v in FACTORS[f] if _allowed({**case, f: v})]
            case[f] = max(options, key=lambda v: (sum(all({**case, f: v}.get(k) == x for k, x in p.items())
                                                      for p in uncovered), v == next(iter(FACTORS[f]))))
        cases.append({f: case[f] for f in FACTORS})
        uncovered = [p for p in uncovered if not all(case[k] == v for k, v in p.items())]
    return cases


RUNS, REFUSALS = covering_cases()


def _id(case: dict[str, str]) -> str:
    return ",".join(f"{f}={v}" for f, v in case.items() if v != next(iter(FACTORS[f])))


def _flags(case: dict[str, str], tmp: Path) -> list[str]:
    trace = tmp / "trace.csv"
    trace.write_text("client,seconds_per_step,download_mbps,upload_mbps,available_from,available_for\n" +
                     "".join(f"{c},{0.01 * (c + 1)},100,50,0,86400\n" for c in range(CLIENTS)))
    flags = ["simulate", "--clients", str(CLIENTS), "--rounds", "2", "--local-epochs", "1", "--workers", "1",
             "--quiet", "--out", str(tmp / "out")]
    for f, level in case.items():
        flags += [x.format(trace=trace) for x in FACTORS[f][level]]
    return flags


def test_the_cover_has_every_allowed_pair_and_each_refused_pair_once():
    for f, g in itertools.combinations(FACTORS, 2):
        for a, b in itertools.product(FACTORS[f], FACTORS[g]):
            if _allowed({f: a, g: b}):
                assert any(c[f] == a and c[g] == b for c in RUNS), (f, a, g, b)
    assert all(_refused(c) is not None for c in REFUSALS)
    assert all(_allowed(c) for c in RUNS)
    assert len(RUNS) < 40  # pairwise, not the product of the levels (7 x 3 x 2^7 = 2688)


def test_the_docs_show_the_table_the_refusals_come_from():
    assert markdown_table() in DOC.read_text()


@pytest.mark.parametrize("case", RUNS, ids=_id)
def test_an_allowed_combination_runs_and_learns(case, tmp_path):
    assert main(_flags(case, tmp_path)) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    chance = 1 / 3 if case["task"] == "on" else 1 / 10  # wine's 3 classes, digits' 10
    assert rows[-1]["test_accuracy"] > chance + 0.15, rows
    if case["ranks"] == "2":  # the second rank took uploads (a secure round's all go to rank 0, which unmasks)
        assert all(r["r1_uploads"] == (0 if case["secagg"] == "on" else CLIENTS // 2) for r in rows), rows


def _documented_reasons() -> list[str]:
    return [row.split(" | ")[-1].rstrip(" |") for row in DOC.read_text().splitlines()
            if row.startswith("| ") and row.count(" | ") == 2]


@pytest.mark.parametrize("case", REFUSALS, ids=_id)
def test_a_refused_combination_says_why_in_the_documented_line(case, tmp_path, capsys):
    assert main(_flags(case, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    line = err.removeprefix("fedpar simulate: ").rstrip("\n")
    assert line == _refused(case)
    reason = re.sub(r"^.*? cannot run with .*?: ", "", line)
    assert reason in _documented_reasons() and reason in {c.reason for c in CLASHES}
