"""The pairwise cover of `fedpar simulate`'s features that tests/test_composition.py and
tests/test_composition_runs.py run: the factors and their flags, the cover, and the check of one run."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import random
from pathlib import Path

import pytest

from fedpar.aggregation.compatibility import composition_features, refusal
from fedpar.cli.main import main
from support.processes import stacks_if_slow

ROOT = Path(__file__).resolve().parents[2]
SLOW_SECONDS = 240  # a case takes seconds; pytest's timeout (pyproject.toml) is 300
TASK = ["--task", "examples/own_task.py:task", "--task-option", f"csv={ROOT / 'examples' / 'table.csv'}"]
CLIENTS = 4
# Each factor's levels, the first being "off"; a level is the flags it adds.
FACTORS: dict[str, dict[str, list[str]]] = {
    "strategy": {"fedavg": [], "fedprox": ["--strategy", "fedprox", "--strategy-option", "mu=0.01"],
                 "fedadam": ["--strategy", "fedadam", "--strategy-option", "eta=0.03"],
                 "median": ["--strategy", "median"], "trimmed_mean": ["--strategy", "trimmed_mean"],
                 "krum": ["--strategy", "krum"], "flower": ["--strategy", "flower:flwr.server.strategy:FedAvg"],
                 "flower_median": ["--strategy", "flower:FedMedian"]},
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


def features(case: dict[str, str]) -> dict[str, str]:
    """The table's features a case turns on, named as `fedpar simulate` names them."""
    strategy = case["strategy"]
    name = FACTORS["strategy"][strategy][1] if FACTORS["strategy"][strategy] else "fedavg"
    return composition_features(f"dp-{name}" if case["dp"] != "none" else name, case["secagg"] == "on",
                                "int8" if case["compression"] == "on" else "none",
                                privacy="off" if case["dp"] == "none" else case["dp"])


def refused(case: dict[str, str]) -> str | None:
    return refusal(features(case))


def allowed(case: dict[str, str]) -> bool:
    """Whether a (partial) case runs: no refused pair in it, and no pending one."""
    return _allowed(frozenset(case.items()))


@functools.cache  # the greedy cover asks of the same partial cases again and again (seconds at every collection)
def _allowed(levels: frozenset[tuple[str, str]]) -> bool:
    case = dict(levels)
    full = {f: case.get(f, next(iter(each))) for f, each in FACTORS.items()}
    pairs = {frozenset(p) for p in itertools.combinations(case.items(), 2)}
    return refused(full) is None and not pairs & PENDING.keys()


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
            if allowed(pair):
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
            options = [v for v in FACTORS[f] if allowed({**case, f: v})]
            gained = _pairs_gained(case, f, uncovered)
            case[f] = max(options, key=lambda v: (gained.get(v, 0), v == next(iter(FACTORS[f]))))
        cases.append({f: case[f] for f in FACTORS})
        uncovered = [p for p in uncovered if not all(case[k] == v for k, v in p.items())]
    return cases


def _pairs_gained(case: dict[str, str], factor: str, pairs: list[dict[str, str]]) -> dict[str, int]:
    """For each level of ``factor`` (not yet in the partial case), how many more of ``pairs`` the case would hold
    both levels of with it: the pairs of that level and a level the case has (the others it holds or not whatever
    the level, so they do not change which level covers most)."""
    gained: dict[str, int] = {}
    for pair in pairs:
        if factor in pair and all(case.get(k) == x for k, x in pair.items() if k != factor):
            gained[pair[factor]] = gained.get(pair[factor], 0) + 1
    return gained


RUNS, REFUSALS = covering_cases()


def case_id(case: dict[str, str]) -> str:
    """The levels of a case that are not off, as a test id."""
    return ",".join(f"{f}={v}" for f, v in case.items() if v != next(iter(FACTORS[f])))


def flags(case: dict[str, str], tmp: Path) -> list[str]:
    """The `fedpar simulate` command line of a case, writing under ``tmp``."""
    trace = tmp / "trace.csv"
    trace.write_text("client,seconds_per_step,download_mbps,upload_mbps,available_from,available_for\n" +
                     "".join(f"{c},{0.01 * (c + 1)},100,50,0,86400\n" for c in range(CLIENTS)))
    args = ["simulate", "--clients", str(CLIENTS), "--rounds", "2", "--local-epochs", "1", "--workers", "1",
            "--quiet", "--no-plot", "--out", str(tmp / "out")]
    for f, level in case.items():
        args += [x.format(trace=trace) for x in FACTORS[f][level]]
    return args


def skip_without_flower(case: dict[str, str]) -> None:
    """Skip a case of a Flower strategy where Flower is not installed (the test extra has it; the GPU box has not)."""
    if case.get("strategy", "").startswith("flower") and importlib.util.find_spec("flwr") is None:
        pytest.skip("needs Flower: pip install 'fedpar[flower]'")


def runs_and_learns(case: dict[str, str], tmp: Path) -> None:
    """Run the case by the command line in this process; both rounds are ok and it learned beyond chance."""
    skip_without_flower(case)
    with stacks_if_slow(SLOW_SECONDS):  # before the suite's timeout: where a stuck case's processes wait
        assert main(flags(case, tmp)) == 0
    rows = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    chance = 1 / 3 if case["task"] == "on" else 1 / 10  # wine's 3 classes, digits' 10
    assert rows[-1]["test_accuracy"] > chance + 0.15, rows
    if case["ranks"] == "2":  # the second rank took uploads (a secure round's all go to rank 0, which unmasks)
        assert all(r["r1_uploads"] == (0 if case["secagg"] == "on" else CLIENTS // 2) for r in rows), rows


def half_of_the_runs(which: int) -> list[dict[str, str]]:
    """Every other run (0 or 1) of the cover, the cases on two aggregator ranks (the costly ones) shared out evenly:
    the two halves are two test files, which pytest-xdist runs on its two workers side by side."""
    return sorted(RUNS, key=lambda c: (c["ranks"], c["tls"], case_id(c)))[which::2]
