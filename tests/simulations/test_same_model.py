"""The default simulation route and deployed agents are one client runtime: the same seed and cohort give the same
model. `fedpar simulate` (worker processes hosting the population) and a real `fedpar serve` with one real
`fedpar client` process per client, each given its member's partition and shuffling seed, run two rounds of digits
with every client sampled; their final global weights agree to float tolerance (only the fold order differs). The
default route (`--client-batching auto`: one by one for this dense model on the CPU) and the stacked route
(`--client-batching on`: the worker's members trained as one torch.func model) both give the deployed model: measured,
the two simulated routes differ by at most 3e-8 (0.15% of the tolerance). The federated evaluation agrees too (a
worker scores its members' validation splits in one pass, each agent its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fedpar.cli.main import main
from fedpar.server.final_model import load_final_model
from fedpar.simulations.population import client_id, client_seed

ROOT = Path(__file__).resolve().parents[2]
CLIENTS, ROUNDS, SEED = 3, 2, 7
TRAINING = ["--dataset", "digits", "--model", "mlp"]
SPLIT = ["--partition", "iid", "--val-fraction", "0.1"]  # the clients' (and the simulated members') shares
ROUND = ["--rounds", str(ROUNDS), "--clients-per-round", str(CLIENTS), "--overselect", "1.0", "--local-epochs", "1",
         "--batch-size", "32", "--lr", "0.1", "--deadline", "60", "--seed", str(SEED)]


def _fedpar(tmp: Path, name: str, args: list[str]) -> subprocess.Popen:
    with open(tmp / f"{name}.log", "w") as log:  # a file, not a pipe: a full pipe would block the process
        return subprocess.Popen([sys.executable, "-m", "fedpar", *args], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _deployed(tmp: Path) -> list[np.ndarray]:
    """serve + one `fedpar client` per member of the simulated population, each as that member."""
    serve = _fedpar(tmp, "serve", ["serve", "--insecure", "--port", "0", "--port-file", str(tmp / "port"), "--out",
                                   str(tmp / "deployed"), "--min-available", str(CLIENTS), *TRAINING, *ROUND])
    clients: list[subprocess.Popen] = []
    try:
        end = time.monotonic() + 60
        while not (tmp / "port").exists():
            assert serve.poll() is None and time.monotonic() < end, (tmp / "serve.log").read_text()
            time.sleep(0.05)
        address = f"127.0.0.1:{int((tmp / 'port').read_text())}"
        for n in range(CLIENTS):
            member = client_id(n)  # the member's id, partition and shuffling seed in the simulation
            clients.append(_fedpar(tmp, member, [
                "client", "--insecure", "--server", address, "--agent-id", member, "--poll", "1", *TRAINING, *SPLIT,
                "--num-partitions", str(CLIENTS), "--partition-index", str(n), "--partition-seed", str(SEED),
                "--seed", str(client_seed(SEED, member))]))
        assert serve.wait(120) == 0, (tmp / "serve.log").read_text()[-3000:]
        for c in clients:
            assert c.wait(60) == 0, (tmp / f"{c.args[c.args.index('--agent-id') + 1]}.log").read_text()[-3000:]
    finally:
        for p in (serve, *clients):
            if p.poll() is None:
                p.kill()
    return load_final_model(tmp / "deployed")[1]


def test_simulate_and_deployed_agents_give_the_same_model_for_the_same_seed_and_cohort(tmp_path):
    routes = {"simulated": [], "stacked": ["--client-batching", "on"]}
    for run, flags in routes.items():
        assert main(["simulate", "--clients", str(CLIENTS), "--workers", "1", "--seats", "2", "--quiet", "--out",
                     str(tmp_path / run), *TRAINING, *SPLIT, *ROUND, *flags]) == 0
    deployed = _deployed(tmp_path)
    rows = {}
    for run in (*routes, "deployed"):  # every client's update counted in every round, on every route
        rows[run] = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [(r["round"], r["status"], r["reported"]) for r in rows[run]] == \
            [(i, "ok", CLIENTS) for i in range(1, ROUNDS + 1)], (run, rows[run])
    for run in routes:  # a worker scores its members together in one pass; each deployed agent scores its own split
        for got, want in zip(rows[run], rows["deployed"]):
            assert got["federated_eval_loss"] == pytest.approx(want["federated_eval_loss"], rel=1e-4), run
        assert rows[run][0]["federated_eval_accuracy"] == pytest.approx(rows["deployed"][0]["federated_eval_accuracy"])
    for run in routes:
        simulated = load_final_model(tmp_path / run)[1]
        assert len(simulated) == len(deployed)
        for got, want in zip(deployed, simulated):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=run)
