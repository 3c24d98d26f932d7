"""The first deployment on one machine: `fedpar serve` and two `fedpar client` agents (digits MLP, default flags), as
fedpar runs them (OpenMP threads wait passively: cli/main.py) against torch's default of threads that spin while they
wait (OMP_WAIT_POLICY=ACTIVE, what every process did before), in alternated pairs in the same run.

One command: ``.venv/bin/python benchmarks/deployed_threads.py`` (``--pairs N``, default 3; ``--rounds R``, default
6). For each run it prints the median round seconds (rounds 2..R from metrics.jsonl) and, at the end, the median
over the pairs of the ratio spinning / passive. The results go to benchmarks/results/deployed_threads.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results import write_results  # noqa: E402  (benchmarks/, this script's folder)

from fedpar.cli.argtypes import FedparParser  # noqa: E402

FEDPAR = [sys.executable, "-m", "fedpar.cli.main"]


def one_run(folder: Path, rounds: int, wait_policy: str | None) -> float:
    """Serve and two agents on loopback until the last round: the median of rounds 2..R's seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    folder.mkdir(parents=True)
    serve = subprocess.Popen([*FEDPAR, "serve", "--insecure", "--port", "0", "--port-file", str(folder / "port"),
                              "--rounds", str(rounds), "--min-available", "2", "--clients-per-round", "2", "--out",
                              str(folder / "out")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agents = []
    try:
        end = time.monotonic() + 60
        while not (folder / "port").exists() or not (folder / "port").read_text().strip():
            if serve.poll() is not None or time.monotonic() > end:
                raise RuntimeError("serve did not start")
            time.sleep(0.05)
        address = f"127.0.0.1:{int((folder / 'port').read_text())}"
        agents = [subprocess.Popen([*FEDPAR, "client", "--server", address, "--insecure", "--agent-id", f"a{i}",
                                    "--num-partitions", "2", "--partition-index", str(i)], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]
        if serve.wait(timeout=600) != 0:
            raise RuntimeError(f"serve exited {serve.returncode}")
    finally:
        for process in (serve, *agents):
            if process.poll() is None:
                process.kill()
            process.wait()
    rows = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["round_seconds"] for r in rows[1:])


def main() -> int:
    """Alternate the pairs, print each run and the median ratio, write the results."""
    parser = FedparParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}")
    runs: dict[str, list[float]] = {"passive (fedpar)": [], "spinning (torch's default)": []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for name, policy in (("passive (fedpar)", None), ("spinning (torch's default)", "ACTIVE")):
                seconds = one_run(Path(tmp) / f"{pair}-{policy}", args.rounds, policy)
                runs[name].append(seconds)
                print(f"pair {pair + 1}: {name:28s} median round {seconds:.3f} s", flush=True)
    ratios = [s / p for s, p in zip(runs["spinning (torch's default)"], runs["passive (fedpar)"])]
    ratio = statistics.median(ratios)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"spinning / passive round seconds, median over {args.pairs} pairs: {ratio:.1f}x; load average after: "
          f"{load}")
    write_results(HERE / "results" / "deployed_threads.json",
                  [{"what": "round seconds, serve + 2 agents on one machine, threads spinning (OMP_WAIT_POLICY="
                            "ACTIVE, torch's default)", "ratio": ratio, "against": "fedpar's passive waiting"}],
                  {"rounds": args.rounds, "pairs": args.pairs, "median_round_seconds": runs,
                   "pair_ratios": ratios, "load_average_after": load})
    return 0


if __name__ == "__main__":
    sys.exit(main())
