"""The coordinator's live ids under an availability trace: 100 members going away and coming back, and a cohort of
100 read, at 10^5, 10^6 and 10^7 members, with the ids as a bit mask and rank/select index (server/member_table.py)
against the copy-on-change sorted array it replaced (np.delete to drop, np.insert to add), timed in the same run.

One command:  .venv/bin/python benchmarks/live_ids_bench.py   (writes benchmarks/results/live_ids_bench.json)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from fedpar.cli.argtypes import FedparParser
from fedpar.server.member_table import LiveIds, find, insert_sorted
from results import RESULTS, write_results  # noqa: E402  (benchmarks/, this script's folder)

CHANGED = 100  # members away and back per host call, and the cohort read


def member_ids(n: int) -> np.ndarray:
    """``n`` sorted ids "client-00000000"... as one bytes array, made from digits (not a string each)."""
    digits = (np.arange(n, dtype=np.int64)[:, None] // 10 ** np.arange(7, -1, -1)) % 10 + ord("0")
    rows = np.concatenate([np.frombuffer(b"client-", np.uint8)[None].repeat(n, 0), digits.astype(np.uint8)], 1)
    return rows.reshape(-1).view("S15")


def copied(ids: np.ndarray, picked: np.ndarray, picks: np.ndarray) -> tuple[float, float, float]:
    """The replaced way, as it ran: away drops the ids from a copy (np.delete); back puts them in place in a copy
    (insert_sorted, np.insert); a cohort indexes the array. Seconds of each."""
    started = time.perf_counter()
    live = np.delete(ids, find(ids, picked))
    away = time.perf_counter()
    live = insert_sorted(live, np.sort(picked))[0]
    back = time.perf_counter()
    [live[int(i)].decode() for i in picks]
    return away - started, back - away, time.perf_counter() - back


def masked(live: LiveIds, picked: np.ndarray, picks: np.ndarray) -> tuple[float, float, float]:
    """The mask: away clears bits, back sets them, a cohort is found by rank/select. Seconds of each."""
    started = time.perf_counter()
    live.discard(picked)
    away = time.perf_counter()
    live.add(picked)
    len(live)
    back = time.perf_counter()
    live.take(picks)
    return away - started, back - away, time.perf_counter() - back


def measure(n: int, repeats: int, rng: np.random.Generator) -> dict:
    """Median seconds of each step, both ways, at ``n`` members (all live)."""
    ids = member_ids(n)
    live = LiveIds(ids, np.ones(n, bool), key=None, valid_until=0.0)
    old, new = [], []
    for _ in range(repeats):
        picked = ids[rng.choice(n, CHANGED, replace=False)]
        picks = np.sort(rng.choice(n, CHANGED, replace=False))
        old.append(copied(ids, picked, picks))
        new.append(masked(live, picked, picks))
        assert len(live) == n
    steps = ("away", "back", "cohort")
    row = {"members": n, "repeats": repeats,
           "old_seconds": {s: statistics.median(t[i] for t in old) for i, s in enumerate(steps)},
           "new_seconds": {s: statistics.median(t[i] for t in new) for i, s in enumerate(steps)},
           "old_bytes_per_member": ids.nbytes / n,  # the old live set: its own sorted copy of the live ids
           "new_bytes_per_member": live.index_bytes / n}  # the mask and index (the ids: the member table's)
    for side in ("old_seconds", "new_seconds"):
        row[side]["away_and_back"] = row[side]["away"] + row[side]["back"]
    return row


def main(argv: list[str] | None = None) -> int:
    """Time both ways at each size; print the table and the ratios; write the JSON."""
    ap = FedparParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, nargs="+", default=[10**5, 10**6, 10**7], help="population sizes")
    ap.add_argument("--repeats", type=int, default=20, help="away/back rounds timed per size (the median is kept)")
    ap.add_argument("--json", type=Path, default=RESULTS / "live_ids_bench.json", help="where the results go")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"{CHANGED} members away and back, then a cohort of {CHANGED} read; load average {' '.join(load)}")
    print(f"{'members':>10} {'copy: away':>11} {'back':>9} {'cohort':>9} {'mask: away':>11} {'back':>9} "
          f"{'cohort':>9} {'away+back':>10} {'B/member':>14}")
    rows, ratios = [], []
    for n in args.members:
        row = measure(n, args.repeats, rng)
        rows.append(row)
        old, new = row["old_seconds"], row["new_seconds"]
        speedup = old["away_and_back"] / new["away_and_back"]
        print(f"{n:>10,} {old['away'] * 1e3:>9.3f}ms {old['back'] * 1e3:>7.3f}ms {old['cohort'] * 1e3:>7.3f}ms "
              f"{new['away'] * 1e3:>9.3f}ms {new['back'] * 1e3:>7.3f}ms {new['cohort'] * 1e3:>7.3f}ms "
              f"{speedup:>9.1f}x {row['old_bytes_per_member']:>5.1f} -> {row['new_bytes_per_member']:.3f}",
              flush=True)
        ratios.append({"what": f"{CHANGED} members away and back at {n:,} members, copy-on-change / mask",
                       "ratio": round(speedup, 2), "against": "np.delete/np.insert on the sorted live ids, same run"})
        ratios.append({"what": f"a cohort of {CHANGED} read at {n:,} members, mask / copy-on-change array",
                       "ratio": round(new["cohort"] / old["cohort"], 2), "against": "indexing the sorted array"})
    after = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load average after: {' '.join(after)}")
    write_results(args.json, ratios, {"rows": rows, "load_average": {"before": load, "after": after}})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
