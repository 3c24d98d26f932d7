"""Client-side DP under secure aggregation against the same DP in the clear, same run.

One command: ``.venv/bin/python benchmarks/secure_dp_bench.py`` (``--quick`` for a smoke run).

It runs `fedpar simulate` on digits (the MLP, --clients clients all sampled with quantity-skewed shares, one local
epoch, --privacy client with adaptive clipping) three ways, alternated --repeats times: DP in the clear (each agent
clips and reports its clip bit; the coordinator re-clips, sums and noises), the same DP under --secure-aggregation
(each agent clips, masks its update with weight 1 and its clip bit after it; the coordinator noises the unmasked sum
and counts the bits), and secure aggregation without DP. For each: the steady round (the median of the seconds from
one metrics row to the next, rounds 2..R, as benchmarks/population_bench.py --steady measures it), the final test
accuracy, and the round-1 dp_clipped_fraction (the same seed trains the same first round, so the masked count must
equal the clear one).
Ratios: secure DP over clear DP, and secure DP over secure without DP (what the clip bit and the noise cost).
Results: benchmarks/results/secure_dp_bench.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from population_bench import run_simulate  # noqa: E402  (benchmarks/, this script's folder)
from results import RESULTS, write_results  # noqa: E402

from fedpar.cli.argtypes import FedparParser  # noqa: E402

DP = ["--privacy", "client", "--privacy-noise", "0.3", "--privacy-clip", "0.3", "--privacy-adaptive-quantile", "0.5"]
WAYS = {"dp_clear": DP, "dp_secure": [*DP, "--secure-aggregation"], "secure": ["--secure-aggregation"]}


def main() -> int:
    """Run the three ways and write the JSON."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 clients, 4 rounds, once")
    p.add_argument("--json", type=Path, default=RESULTS / "secure_dp_bench.json")
    a = p.parse_args()
    clients, rounds, repeats = (4, 4, 1) if a.quick else (a.clients, a.rounds, a.repeats)
    # quantity-skewed shares: the agents' updates differ in size, so C clips some of them (0.3: 4 of 10 in round 1)
    job = ["--dataset", "digits", "--model", "mlp", "--local-epochs", "1", "--clients", str(clients),
           "--rounds", str(rounds), "--seed", "0", "--partition", "quantity:1"]
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(repeats):
            for way, flags in WAYS.items():
                run = run_simulate([*job, *flags], Path(tmp) / f"{way}-{n}")
                rows = run["rows"]
                runs[way].append({"steady_round_seconds": run["steady_period_seconds"],
                                  "final_test_accuracy": rows[-1]["test_accuracy"],
                                  "round1_clipped_fraction": rows[0].get("dp_clipped_fraction"),
                                  "final_dp_epsilon": rows[-1].get("dp_epsilon")})
    median = {way: {key: statistics.median(r[key] for r in rs) if rs[0][key] is not None else None
                    for key in rs[0]} for way, rs in runs.items()}
    print(f"{'way':>10}{'round ms':>10}{'accuracy':>10}{'clipped r1':>12}{'epsilon':>9}")
    for way, m in median.items():
        clipped = "-" if m["round1_clipped_fraction"] is None else f"{m['round1_clipped_fraction']:.2f}"
        epsilon = "-" if m["final_dp_epsilon"] is None else f"{m['final_dp_epsilon']:.1f}"
        print(f"{way:>10}{m['steady_round_seconds'] * 1e3:>10.1f}{m['final_test_accuracy']:>10.3f}{clipped:>12}"
              f"{epsilon:>9}")
    secure, clear, plain_secure = median["dp_secure"], median["dp_clear"], median["secure"]
    ratios = [{"what": f"steady round of client-side DP under secure aggregation, digits MLP, {clients} of {clients}",
               "ratio": secure["steady_round_seconds"] / clear["steady_round_seconds"],
               "against": "the same DP in the clear, same run"},
              {"what": "the same, against secure aggregation without DP",
               "ratio": secure["steady_round_seconds"] / plain_secure["steady_round_seconds"],
               "against": "secure aggregation without DP, same run"},
              {"what": f"final test accuracy of client-side DP under secure aggregation after {rounds} rounds",
               "ratio": secure["final_test_accuracy"] / clear["final_test_accuracy"],
               "against": "the same DP in the clear, same run"}]
    path = write_results(a.json, ratios, {"clients": clients, "rounds": rounds, "runs": runs, "medians": median})
    print(f"secure DP / clear DP round: {ratios[0]['ratio']:.2f}; secure DP / secure round: {ratios[1]['ratio']:.2f}; "
          f"accuracy ratio {ratios[2]['ratio']:.3f}; round-1 clipped fraction {secure['round1_clipped_fraction']} "
          f"(clear {clear['round1_clipped_fraction']})\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
