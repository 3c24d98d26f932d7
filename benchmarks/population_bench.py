"""Simulation at population scale: `fedpar simulate` (its population route, the only one) with populations of 100 to 100,000 clients
at 100 per round, next to the same rounds as one plain PyTorch loop (fedavg_floor.py), measured in the same run.

One command: ``.venv/bin/python benchmarks/population_bench.py`` (``--quick``: 100 and 10,000 only, 4 rounds).
For each population N it runs, each in a fresh process:
- `fedpar simulate` on Synthetic(0.5, 0.5) (FedProx's generated benchmark, --partition natural,
  a median of 5 examples per client, so every population's clients are alike), 100 clients per round, one
  local epoch, 2 worker processes, no federated evaluation (`--client-eval-every 0`, as the floor has none):
  time to the first round's start, steady round seconds (median of rounds
  2..R), and the peak memory of the whole process tree (sum of the processes' PSS, sampled every 0.2 s);
- the floor: the same rounds (same data, cohorts, seeds and local SGD) as one plain PyTorch loop, no service.
It prints the round time as a ratio to the floor's (the cost of going through the real service, per round of
100 sampled clients) and to the N=100 cell's (what a larger population costs). With ``--mnist-dir`` holding
MNIST it also runs the issue's MNIST cells: 10,000 clients of six examples each against 100 such clients.
Then a straggler study (digits, 100 clients, 20 per round of 26 sampled, 30% slow devices, a 1 s deadline, until
90% test accuracy) run twice: on the real clock, waiting for the slow devices as a deployment would, and on the
virtual clock (`--clock virtual`), where only the first K in simulated time train. It prints the rounds, simulated
and wall seconds to 90% for both, and the wall-time ratio. ``--straggler-only`` runs just that.
Results go to runs/population_bench.json.

``--scale`` runs instead the population-size table (issue 34): ``fedpar simulate --clients N --clients-per-round 100
--dataset synthetic:1:1 --rounds 5`` with no other flag, for N = 10^3, 10^4, 10^5 and 10^6, one at a time, and
prints for each the set-up seconds (start to the first round's start), the whole process tree's peak PSS, the bytes
each member adds (the tree's peak above the 10^3 run's, per member more), the steady round seconds (median of
rounds 2..5) and its ratio to the 10^3 run's, and the wall seconds of the whole command; then the same rounds at 10^3
and 10^7 members with `fedpar serve --accept-populations` and 2 local torchrun ranks of `fedpar simulate-workers`
(the 10^7 row against the 10^3 one of that kind; a failed row is kept and the table goes on). Then a learning check:
10^6 members of ``synthetic:0:0`` and of ``synthetic:iid`` (FedProx's Synthetic-IID), 10 rounds each, the test
accuracy in the first and the last round (Synthetic(0, 0) stays near chance on clients it never trained on:
datasets/synthetic.py says why).
It writes benchmarks/results/population_scale.json (the load average beside each row).

``--steady`` runs instead issue 25's steady-round cells: digits MLP, one local epoch, 10 of 10, 100 of 100 and 10 of
100 clients, ``--rounds`` rounds (default 11). For each cell, in the same run: `fedpar simulate` with default flags
(each round: the coordinator samples, the clients download, score the model they received on their validation
split, train and upload; the coordinator folds and evaluates centrally), the same with ``--client-eval-every 0``
(the floor's work: no federated evaluation) and the floor (fedavg_floor.py: the same cohorts, data, seeds and local
SGD in one plain loop, one thread, with the central evaluation). It prints each one's steady round seconds (for
simulate the median of the seconds from one round's metrics row to the next, rounds 2..R, which counts the gap
between rounds that a round's own round_seconds leaves out; the floor's rounds run back to back) and the ratios to
the floor, with the load average, and writes benchmarks/results/steady_round.json. benchmarks/round_timeline.py shows where a round of the 10-of-100 cell goes.
``--partials`` runs the same cells with a host's updates pre-summed (the default for a linear strategy) and one by
one (FEDPAR_HOST_PARTIALS=0), both against the floor in the same run: benchmarks/results/host_partials.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
PER_ROUND = 100


def tree_pss_mib(root: int) -> float:
    """PSS of ``root`` and every descendant, in MiB (shared pages counted once, in shares)."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration, ValueError):
            continue  # the process ended meanwhile
    return total / 1024


def run_simulate(args: list[str], out: Path, env: dict[str, str] | None = None, python: str = sys.executable) -> dict:
    """One `fedpar simulate` run (``env``: added to its environment; ``python``: of the venv whose fedpar runs): its
    rows, the time to its first round's start, and its peak tree memory."""
    started = time.monotonic()
    proc = subprocess.Popen([python, "-m", "fedpar", "simulate", *args, "--out", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    peak, first_row_at = 0.0, None
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        peak = max(peak, tree_pss_mib(proc.pid))
        if first_row_at is None and metrics.exists() and metrics.stat().st_size:
            first_row_at = time.monotonic() - started
        time.sleep(0.2)
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"simulate failed ({proc.returncode}): {stderr[-2000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    startup = (first_row_at or 0.0) - rows[0]["round_seconds"]
    return {"rows": rows, "startup_seconds": startup, "peak_tree_mib": peak,
            "steady_round_seconds": statistics.median(r["round_seconds"] for r in rows[1:]),
            "steady_period_seconds": steady_period(rows),
            "failed_rounds": sum(r["status"] != "ok" for r in rows), "wall_seconds": time.monotonic() - started}


def steady_period(rows: list[dict]) -> float:
    """Seconds from one round's metrics row to the next one's, median over rounds 2..R: what a round costs at steady
    state, the gap between two rounds included (a round's own ``round_seconds`` leaves it out)."""
    return statistics.median(b["wall_seconds"] - a["wall_seconds"] for a, b in zip(rows[1:], rows[2:]))


def run_floor(args: list[str]) -> dict:
    """The same rounds as plain PyTorch in one process (benchmarks/fedavg_floor.py)."""
    out = subprocess.run([sys.executable, str(HERE / "fedavg_floor.py"), *args], capture_output=True, text=True,
                         check=True)
    result = json.loads(out.stdout)
    result["steady_round_seconds"] = statistics.median(r["round_seconds"] for r in result["rounds"][1:])
    return result


def cell(name: str, clients: int, job: list[str], floor_job: list[str], tmp: Path) -> dict:
    """One population: the simulation and its floor."""
    shared = ["--clients", str(clients), "--clients-per-round", str(PER_ROUND), "--local-epochs", "1", *job]
    # --client-eval-every 0: the clients do the floor's work (train; the coordinator evaluates centrally), with no
    # federated evaluation of the model they receive, which the floor does not do either
    sim = run_simulate([*shared, "--client-eval-every", "0"], tmp / f"{name}-{clients}")
    floor = run_floor(["--clients", str(clients), "--clients-per-round", str(PER_ROUND), "--local-epochs", "1",
                       *floor_job])
    sim.pop("rows")
    return {"population": clients, **sim, "floor_round_seconds": floor["steady_round_seconds"],
            "vs_floor": sim["steady_round_seconds"] / floor["steady_round_seconds"]}


STRAGGLER_STUDY = ["--dataset", "digits", "--clients", "100", "--clients-per-round", "20", "--overselect", "1.3",
                   "--local-epochs", "5", "--lr", "0.2", "--slow-fraction", "0.3", "--slow-step-delay", "0.2",
                   "--deadline", "1.0", "--seed", "1"]
TARGET_ACCURACY = 0.9


def to_target(rows: list[dict]) -> dict:
    """Rounds, wall seconds (from the first round's start) and simulated seconds until the target accuracy."""
    start = rows[0]["wall_seconds"] - rows[0]["round_seconds"]
    hit = next((r for r in rows if (r.get("test_accuracy") or 0.0) >= TARGET_ACCURACY), None)
    return {"rounds_to_target": hit["round"] if hit else None,
            "wall_seconds_to_target": hit["wall_seconds"] - start if hit else None,
            "sim_seconds_to_target": hit.get("sim_seconds", hit["wall_seconds"] - start) if hit else None,
            "mean_round_seconds": statistics.mean(r["round_seconds"] for r in rows),
            "final_test_accuracy": rows[-1].get("test_accuracy")}


def straggler_study(rounds: int, tmp: Path) -> dict:
    """The straggler study on the real clock and on the virtual clock, same settings and seed."""
    args = [*STRAGGLER_STUDY, "--rounds", str(rounds)]
    real = run_simulate(args, tmp / "straggler-real")
    virtual = run_simulate([*args, "--clock", "virtual"], tmp / "straggler-virtual")
    out = {"real": to_target(real["rows"]), "virtual": to_target(virtual["rows"])}
    print(f"\nstraggler study (30% slow, 1 s deadline), to {TARGET_ACCURACY:.0%} test accuracy:")
    print(f"{'clock':<9}{'rounds':>7}{'sim s':>8}{'wall s':>8}{'round s':>9}{'final acc':>10}")
    for clock, r in out.items():
        cells = [f"{r[k]:>{w}.{d}f}" if r[k] is not None else f"{'-':>{w}}"
                 for k, w, d in (("sim_seconds_to_target", 8, 2), ("wall_seconds_to_target", 8, 2),
                                 ("mean_round_seconds", 9, 3), ("final_test_accuracy", 10, 3))]
        print(f"{clock:<9}{r['rounds_to_target'] or '-':>7}" + "".join(cells))
    if out["real"]["wall_seconds_to_target"] and out["virtual"]["wall_seconds_to_target"]:
        out["wall_ratio_real_to_virtual"] = out["real"]["wall_seconds_to_target"] / \
            out["virtual"]["wall_seconds_to_target"]
        print(f"the virtual clock reached it {out['wall_ratio_real_to_virtual']:.1f}x sooner in wall time")
    out["failed_rounds"] = real["failed_rounds"] + virtual["failed_rounds"]
    return out


SCALE_POPULATIONS = (1_000, 10_000, 100_000, 1_000_000)
LEARNING_DATASETS = ("synthetic:0:0", "synthetic:iid")
RANKS_POPULATION, RANKS = 10_000_000, 2
RANKS_LIMIT_SECONDS = 1800


def run_over_ranks(n: int, ranks: int, tmp: Path) -> dict:
    """The same rounds as the table's, with the population hosted by ``ranks`` local torchrun ranks of
    `fedpar simulate-workers` against one `fedpar serve --accept-populations`: as :func:`run_simulate` measures
    them, the peak PSS summed over both process trees."""
    out = tmp / f"ranks-{n}"
    started = time.monotonic()
    serve = subprocess.Popen([sys.executable, "-m", "fedpar", "serve", "--insecure", "--port", "0", "--port-file",
                              str(tmp / f"port-{n}"), "--out", str(out), "--accept-populations",
                              "--min-available", str(n), "--max-agents", str(n),
                              "--clients-per-round", str(PER_ROUND), "--rounds", "5",
                              "--dataset", f"synthetic:1:1:{n}"],
                             stdout=subprocess.DEVNULL, stderr=(tmp / f"serve-{n}.log").open("w"))
    procs, peak, first_row_at = [serve], 0.0, None
    metrics, workers_log = out / "metrics.jsonl", tmp / f"ranks-{n}.log"
    try:
        while not (tmp / f"port-{n}").exists():
            if serve.poll() is not None:
                raise RuntimeError(f"serve failed ({serve.returncode}): "
                                   f"{(tmp / f'serve-{n}.log').read_text()[-2000:]}")
            time.sleep(0.2)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m",
             "fedpar", "simulate-workers", "--insecure", "--server", f"127.0.0.1:{int((tmp / f'port-{n}').read_text())}", "--clients",
             str(n), "--dataset", "synthetic:1:1"],
            stdout=workers_log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        while serve.poll() is None:
            if procs[1].poll() not in (None, 0) or time.monotonic() - started > RANKS_LIMIT_SECONDS:
                raise RuntimeError(f"the workers ended ({procs[1].returncode}) or the run took over "
                                   f"{RANKS_LIMIT_SECONDS} s: {workers_log.read_text()[-2000:]}")
            peak = max(peak, sum(tree_pss_mib(p.pid) for p in procs))
            if first_row_at is None and metrics.exists() and metrics.stat().st_size:
                first_row_at = time.monotonic() - started
            time.sleep(0.5)
        procs[1].wait(max(120.0, RANKS_LIMIT_SECONDS - (time.monotonic() - started)))  # freeing 10^7 members
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if serve.returncode != 0 or procs[1].returncode != 0:
        raise RuntimeError(f"serve ({serve.returncode}) or workers ({procs[1].returncode}) failed: "
                           f"{(tmp / f'serve-{n}.log').read_text()[-2000:]} {workers_log.read_text()[-2000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"startup_seconds": (first_row_at or 0.0) - rows[0]["round_seconds"], "peak_tree_mib": peak,
            "steady_round_seconds": statistics.median(r["round_seconds"] for r in rows[1:]), "ranks": ranks,
            "failed_rounds": sum(r["status"] != "ok" for r in rows), "wall_seconds": time.monotonic() - started}


def scale_table(tmp: Path, populations=SCALE_POPULATIONS, ranks_populations=(1_000, RANKS_POPULATION),
                learning: bool = True) -> dict:
    """The population-size table (``fedpar simulate``; then ``ranks_populations`` on RANKS local ranks of
    simulate-workers against `fedpar serve`, each compared with the smallest run of its own kind) and the learning
    check at a million members (see the module docstring)."""
    print(f"{'population':>11}{'set-up s':>9}{'wall s':>8}{'peak PSS MiB':>13}{'B/member':>9}{'round s':>9}"
          f"{'x 10^3':>8}")
    rows: list[dict] = []
    for n, ranks in [*((n, 0) for n in populations), *((n, RANKS) for n in ranks_populations)]:
        if ranks:
            try:
                r = run_over_ranks(n, ranks, tmp)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # kept in the results, the table goes on
                print(f"{n:>11,}  over {ranks} local ranks FAILED: {str(exc)[-1500:]}", flush=True)
                rows.append({"population": n, "ranks": ranks, "error": str(exc)[-1500:], "failed_rounds": 1})
                continue
        else:
            r = run_simulate(["--clients", str(n), "--clients-per-round", str(PER_ROUND), "--dataset",
                              "synthetic:1:1", "--rounds", "5"], tmp / f"scale-{n}")
            r.pop("rows")
            r["ranks"] = 0
        base = next((c for c in rows if c["ranks"] == ranks and "error" not in c), None)
        r["population"] = n
        r["bytes_per_member"] = (r["peak_tree_mib"] - base["peak_tree_mib"]) * 2**20 / (n - base["population"]) \
            if base else None
        r["vs_smallest"] = r["steady_round_seconds"] / base["steady_round_seconds"] if base else 1.0
        r["load_average"] = Path("/proc/loadavg").read_text().split()[:3]
        rows.append(r)
        per_member = f"{r['bytes_per_member']:>9.0f}" if r["bytes_per_member"] is not None else f"{'-':>9}"
        print(f"{n:>11,}{r['startup_seconds']:>9.1f}{r['wall_seconds']:>8.1f}{r['peak_tree_mib']:>13.0f}{per_member}"
              f"{r['steady_round_seconds']:>9.3f}{r['vs_smallest']:>8.2f}"
              + f"  load {' '.join(r['load_average'])}"
              + (f"  (serve + {ranks} local ranks of simulate-workers)" if ranks else "")
              + ("  (SOME ROUNDS FAILED)" if r["failed_rounds"] else ""), flush=True)
    out: dict = {"cells": rows}
    if learning:
        # Synthetic(0, 0) gives each client its own model, so a shared one scores chance on the clients it has not
        # seen (the central test sample, at 10^6); FedProx's Synthetic-IID is the learnable case at any size
        n = populations[-1]
        out["learning"] = []
        for dataset in LEARNING_DATASETS:
            r = run_simulate(["--clients", str(n), "--clients-per-round", str(PER_ROUND), "--dataset", dataset,
                              "--rounds", "10"], tmp / f"learning-{dataset}")
            accuracy = [row.get("test_accuracy") for row in r["rows"]]
            out["learning"].append({"population": n, "dataset": dataset, "test_accuracy": accuracy,
                                    "failed_rounds": r["failed_rounds"]})
            print(f"learning, {n:,} members of {dataset}: test accuracy {accuracy[0]:.3f} after round 1, "
                  f"{accuracy[-1]:.3f} after round {len(accuracy)}", flush=True)
    return out


def scale_ratios(result: dict) -> list[dict]:
    """The population table's ratios for the results envelope: each population's steady round to the smallest one's
    of the same kind (simulate, or serve and simulate-workers over ranks)."""
    out = []
    for c in result["cells"]:
        if c.get("bytes_per_member") is None:
            continue
        how = f" on {c['ranks']} local ranks" if c["ranks"] else ""
        out.append({"what": f"steady round, synthetic:1:1, {c['population']:,} members{how} "
                            f"({c['peak_tree_mib']:.0f} MiB trees, {c['bytes_per_member']:.0f} B/member)",
                    "ratio": c["vs_smallest"], "against": "the same command at 1,000 members, same run"})
    return out


STEADY_CELLS = ((10, 10), (100, 100), (100, 10))  # (population, sampled per round)


def steady_rounds(rounds: int, tmp: Path) -> dict:
    """Issue 25's steady-round cells (see the module docstring): simulate (default flags, and without federated
    evaluation) against the plain loop, each cell measured in the same run."""
    job = ["--dataset", "digits", "--model", "mlp", "--local-epochs", "1", "--rounds", str(rounds)]
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}")
    print(f"{'cell':>11}{'simulate s':>11}{'no fed-eval s':>14}{'plain s':>9}{'x plain':>8}{'no fed-eval x':>14}")
    cells = []
    for clients, k in STEADY_CELLS:
        shape = ["--clients", str(clients), "--clients-per-round", str(k)]
        default = run_simulate([*job, *shape], tmp / f"steady-{clients}-{k}")
        no_eval = run_simulate([*job, *shape, "--client-eval-every", "0"], tmp / f"steady-{clients}-{k}-no-eval")
        floor = run_floor([*job, *shape])
        c = {"clients": clients, "per_round": k, "simulate_round_seconds": default["steady_period_seconds"],
             "no_fed_eval_round_seconds": no_eval["steady_period_seconds"],
             "plain_round_seconds": floor["steady_round_seconds"],
             "client_batching": json.loads((tmp / f"steady-{clients}-{k}" / "summary.json").read_text())
             .get("client_batching"),
             "failed_rounds": default["failed_rounds"] + no_eval["failed_rounds"]}
        c["vs_plain"] = c["simulate_round_seconds"] / c["plain_round_seconds"]
        c["no_fed_eval_vs_plain"] = c["no_fed_eval_round_seconds"] / c["plain_round_seconds"]
        cells.append(c)
        print(f"{f'{k} of {clients}':>11}{c['simulate_round_seconds']:>11.3f}{c['no_fed_eval_round_seconds']:>14.3f}"
              f"{c['plain_round_seconds']:>9.3f}{c['vs_plain']:>8.2f}{c['no_fed_eval_vs_plain']:>14.2f}"
              + ("  (SOME ROUNDS FAILED)" if c["failed_rounds"] else ""), flush=True)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load average after: {load}")
    return {"rounds": rounds, "cells": cells, "load_average_after": load}


def partial_rounds(rounds: int, repeats: int, tmp: Path) -> dict:
    """The steady-round cells with a host's updates pre-summed (the default) and one by one (FEDPAR_HOST_PARTIALS=0),
    against the plain loop, all in the same run; medians over ``repeats`` alternating runs."""
    job = ["--dataset", "digits", "--model", "mlp", "--local-epochs", "1", "--rounds", str(rounds)]
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}")
    print(f"{'cell':>11}{'partials s':>11}{'per-member s':>13}{'plain s':>9}{'partials x':>11}{'per-member x':>13}"
          f"{'load':>16}")
    cells = []
    for clients, k in STEADY_CELLS:
        shape = ["--clients", str(clients), "--clients-per-round", str(k)]
        runs: dict[str, list[dict]] = {"partials": [], "per_member": []}
        for r in range(repeats):
            for how, flag in (("partials", "1"), ("per_member", "0")):
                runs[how].append(run_simulate([*job, *shape], tmp / f"partials-{clients}-{k}-{how}-{r}",
                                              env={"FEDPAR_HOST_PARTIALS": flag}))
        floor = run_floor([*job, *shape])
        load = Path("/proc/loadavg").read_text().split()[:3]
        c = {"clients": clients, "per_round": k, "plain_round_seconds": floor["steady_round_seconds"],
             "load_average": load, "failed_rounds": sum(x["failed_rounds"] for xs in runs.values() for x in xs)}
        for how, xs in runs.items():
            c[f"{how}_round_seconds"] = statistics.median(x["steady_period_seconds"] for x in xs)
            c[f"{how}_vs_plain"] = c[f"{how}_round_seconds"] / c["plain_round_seconds"]
            c[f"{how}_fold_groups"] = statistics.median(statistics.median(r["r0_fold_groups"] for r in x["rows"][1:])
                                                        for x in xs)
        c["partials_vs_per_member"] = c["partials_round_seconds"] / c["per_member_round_seconds"]
        cells.append(c)
        print(f"{f'{k} of {clients}':>11}{c['partials_round_seconds']:>11.3f}{c['per_member_round_seconds']:>13.3f}"
              f"{c['plain_round_seconds']:>9.3f}{c['partials_vs_plain']:>11.2f}{c['per_member_vs_plain']:>13.2f}"
              f"{' '.join(load):>16}" + ("  (SOME ROUNDS FAILED)" if c["failed_rounds"] else ""), flush=True)
    return {"rounds": rounds, "repeats": repeats, "cells": cells}


def partial_ratios(result: dict) -> list[dict]:
    """The partials cells' ratios for the results envelope."""
    out = []
    for c in result["cells"]:
        cell = f"digits MLP, E1, {c['per_round']} of {c['clients']} clients (load {' '.join(c['load_average'])})"
        out.append(vs_plain(f"steady round of fedpar simulate, host partials, {cell}", c["partials_vs_plain"]))
        out.append(vs_plain(f"steady round of fedpar simulate, per-member uploads, {cell}", c["per_member_vs_plain"]))
        out.append({"what": f"steady round of fedpar simulate, host partials, {cell}",
                    "ratio": c["partials_vs_per_member"], "against": "per-member uploads, same run"})
    return out


def vs_plain(what: str, ratio: float) -> dict:
    """One ratio against the plain loop, for the results envelope."""
    return {"what": what, "ratio": ratio,
            "against": "the same rounds in one plain PyTorch loop (fedavg_floor.py), same run"}


# (model, population, sampled per round); mnist-cnn: the FedAvg paper's round (MNIST, its CNN, B10, E1 of its 5)
BATCHING_CELLS = (("mlp", 10, 10), ("mlp", 100, 100), ("mlp", 100, 10), ("cnn", 10, 10), ("cnn", 100, 100),
                  ("cnn", 100, 10), ("mnist-cnn", 100, 10))


def batching_rounds(rounds: int, repeats: int, tmp: Path, models: tuple[str, ...] = ("mlp", "cnn"),
                    mnist_dir: str = "") -> dict:
    """Issue 25's client-batching comparison: each cell's steady round (default flags otherwise; the median of the
    seconds from one metrics row to the next, rounds 2..R, as --steady measures it) with ``--client-batching on``
    and ``off``, alternated ``repeats`` times in the same run (the first of a pair alternating too), each pair's
    ratio on/off and the cell's median of them."""
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}")
    print(f"{'cell':>18}{'on s':>8}{'off s':>8}{'on/off':>8}  load")
    pairs, cells = [], []
    for model, clients, k in [c for c in BATCHING_CELLS if c[0] in models]:
        ratios, loads = [], []
        job = ["--dataset", "digits", "--local-epochs", "1", "--rounds", str(rounds)]
        if model == "mnist-cnn":  # seconds a round: 4 rounds
            job = ["--dataset", "mnist", "--data-dir", mnist_dir, "--local-epochs", "1", "--batch-size", "10",
                   "--rounds", str(min(rounds, 4))]
        for repeat in range(repeats):
            shape = ["--model", model.removeprefix("mnist-"), "--clients", str(clients), "--clients-per-round", str(k)]
            runs, cpu = {}, {}
            for how in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                runs[how] = run_simulate([*job, *shape, "--client-batching", how],
                                         tmp / f"{how}-{model}-{clients}-{k}-{repeat}")
                after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the whole process tree, start-up included
                cpu[how] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            load = Path("/proc/loadavg").read_text().split()[:3]
            c = {"model": model, "clients": clients, "per_round": k,
                 "on_round_seconds": runs["on"]["steady_period_seconds"],
                 "off_round_seconds": runs["off"]["steady_period_seconds"], "load_average": load,
                 "on_cpu_seconds": cpu["on"], "off_cpu_seconds": cpu["off"], "cpu_on_vs_off": cpu["on"] / cpu["off"],
                 "failed_rounds": runs["on"]["failed_rounds"] + runs["off"]["failed_rounds"]}
            c["on_vs_off"] = c["on_round_seconds"] / c["off_round_seconds"]
            pairs.append(c)
            ratios.append(c["on_vs_off"])
            loads.append(float(load[0]))
            print(f"{f'{model} {k} of {clients}':>18}{c['on_round_seconds']:>8.3f}{c['off_round_seconds']:>8.3f}"
                  f"{c['on_vs_off']:>8.2f}  {' '.join(load)}  whole-run CPU on/off {c['cpu_on_vs_off']:.2f}"
                  + ("  (SOME ROUNDS FAILED)" if c["failed_rounds"] else ""),
                  flush=True)
        cells.append({"model": model, "clients": clients, "per_round": k, "pairs": len(ratios),
                      "median_on_vs_off": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                      "median_cpu_on_vs_off": statistics.median(p["cpu_on_vs_off"] for p in pairs[-len(ratios):]),
                      "load_1min": [min(loads), max(loads)]})
        print(f"{f'{model} {k} of {clients}':>18}  median on/off {cells[-1]['median_on_vs_off']:.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs)", flush=True)
    return {"rounds": rounds, "repeats": repeats, "cells": cells, "pairs": pairs}


def steady_ratios(result: dict) -> list[dict]:
    """The steady-round cells' ratios for the results envelope."""
    out = []
    for c in result["cells"]:
        # a loaded machine flatters simulate: its processes get more of the cores than the plain loop's one thread
        cell = (f"digits MLP, E1, {c['per_round']} of {c['clients']} clients "
                f"(load after {result['load_average_after'][0]})")
        out.append(vs_plain(f"steady round of fedpar simulate (default flags), {cell}", c["vs_plain"]))
        out.append(vs_plain(f"steady round of fedpar simulate --client-eval-every 0, {cell}", c["no_fed_eval_vs_plain"]))
    return out


def main() -> int:
    """Run the cells and print the table."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="populations 100 and 10,000, 4 rounds")
    p.add_argument("--rounds", type=int, help="rounds per run (default 10; --steady: 11)")
    p.add_argument("--mnist-dir", default=str(HERE.parent.parent / "shared" / "data" / "mnist"))
    p.add_argument("--json", type=Path, help="where the results go (default: runs/population_bench.json; --scale: "
                   "benchmarks/results/population_scale.json)")
    p.add_argument("--straggler-only", action="store_true", help="only the straggler study")
    p.add_argument("--straggler-rounds", type=int, default=25)
    p.add_argument("--scale", action="store_true", help="the population-size table, 10^3 to 10^6 members, and 10^7 on 2 local ranks")
    p.add_argument("--steady", action="store_true",
                   help="the steady-round cells: digits MLP, 10 of 10, 100 of 100, 10 of 100, vs a plain loop")
    p.add_argument("--batching", action="store_true",
                   help="steady rounds with --client-batching on against off: digits MLP and CNN 10 of 10, 100 of "
                        "100 and 10 of 100, and the FedAvg paper's MNIST CNN round (10 of 100, B10, E1)")
    p.add_argument("--models", default="mlp,cnn", help="--batching: the cells of these models only (mlp, cnn, "
                   "mnist-cnn)")
    p.add_argument("--partials", action="store_true",
                   help="the steady-round cells with a host's updates pre-summed and one by one, vs a plain loop")
    p.add_argument("--repeats", type=int, default=2, help="--batching: on/off pairs per cell; --partials: runs of each")
    a = p.parse_args()
    a.json = a.json if a.json or a.scale else Path("runs/population_bench.json")
    if a.batching:
        with tempfile.TemporaryDirectory() as tmp:
            result = batching_rounds(a.rounds or 8, a.repeats, Path(tmp), tuple(a.models.split(",")), a.mnist_dir)
        ratios = []
        for c in result["cells"]:
            shape = (f"{c['model']} (digits unless mnist-), E1, {c['per_round']} of {c['clients']} clients, median of "
                    f"{c['pairs']} pairs, load {c['load_1min'][0]:.1f}-{c['load_1min'][1]:.1f}")
            ratios += [{"what": f"steady round of fedpar simulate --client-batching on, {shape} "
                                f"({c['min']:.2f}-{c['max']:.2f})",
                        "ratio": c["median_on_vs_off"], "against": "--client-batching off, alternated in the same run"},
                       {"what": f"CPU seconds of the whole fedpar simulate process tree, --client-batching on, {shape}",
                        "ratio": c["median_cpu_on_vs_off"],
                        "against": "--client-batching off, alternated in the same run"}]
        # the MLP cells' file, or the convolutional cells' beside it
        name = "client_batching.json" if "mlp" in a.models.split(",") else "client_batching_cnn.json"
        path = write_results(HERE / "results" / name, ratios, result)
        print(f"wrote {path}")
        return 0 if not sum(c["failed_rounds"] for c in result["pairs"]) else 1
    if a.partials:
        with tempfile.TemporaryDirectory() as tmp:
            result = partial_rounds(a.rounds or 11, a.repeats, Path(tmp))
        path = write_results(HERE / "results" / "host_partials.json", partial_ratios(result), result)
        print(f"wrote {path}")
        return 0 if not sum(c["failed_rounds"] for c in result["cells"]) else 1
    if a.steady:
        with tempfile.TemporaryDirectory() as tmp:
            result = steady_rounds(a.rounds or 11, Path(tmp))
        path = write_results(HERE / "results" / "steady_round.json", steady_ratios(result), result)
        print(f"wrote {path}")
        return 0 if not sum(c["failed_rounds"] for c in result["cells"]) else 1
    if a.scale:
        with tempfile.TemporaryDirectory() as tmp:
            result = scale_table(Path(tmp))
        path = write_results(a.json or HERE / "results" / "population_scale.json", scale_ratios(result),
                             {"scale": result})
        print(f"wrote {path}")
        failed = sum(c["failed_rounds"] for c in [*result["cells"], *result.get("learning", [])])
        return 0 if not failed else 1
    rounds = 4 if a.quick else a.rounds or 10
    populations = [100, 10_000] if a.quick else [100, 1_000, 10_000, 100_000]
    results: dict[str, list[dict]] = {}
    print(f"{'data':<10}{'population':>11}{'start-up s':>11}{'round s':>9}{'floor s':>9}{'x floor':>8}"
          f"{'x N=100':>8}{'tree MiB':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        if a.straggler_only:
            populations = []
        jobs = {"synthetic": lambda n: ([f"--dataset=synthetic:0.5:0.5:{n}:5", "--partition", "natural",
                                         "--rounds", str(rounds)],
                                        [f"--dataset=synthetic:0.5:0.5:{n}:5", "--partition", "natural",
                                         "--rounds", str(rounds)])}
        if (Path(a.mnist_dir) / "train.npz").exists():
            mnist = ["--dataset", "mnist", "--data-dir", a.mnist_dir, "--examples-per-client", "6",
                     "--val-fraction", "0", "--rounds", str(rounds)]
            jobs["mnist"] = lambda n: (mnist, mnist)
        for name, job in jobs.items() if populations else ():
            cells = results.setdefault(name, [])
            for n in (populations if name == "synthetic" else [100, 10_000]):
                c = cell(name, n, *job(n), Path(tmp))
                c["vs_population_100"] = c["steady_round_seconds"] / cells[0]["steady_round_seconds"] if cells \
                    else 1.0
                cells.append(c)
                print(f"{name:<10}{n:>11,}{c['startup_seconds']:>11.2f}{c['steady_round_seconds']:>9.3f}"
                      f"{c['floor_round_seconds']:>9.3f}{c['vs_floor']:>8.2f}{c['vs_population_100']:>8.2f}"
                      f"{c['peak_tree_mib']:>10.0f}" + ("  (SOME ROUNDS FAILED)" if c["failed_rounds"] else ""),
                      flush=True)
        study = straggler_study(a.straggler_rounds, Path(tmp))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({**results, "straggler_study": study}, indent=2))
    print(f"wrote {a.json}")
    failed = study["failed_rounds"] + sum(c["failed_rounds"] for cells in results.values() for c in cells)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
