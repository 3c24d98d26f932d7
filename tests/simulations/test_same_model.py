"""The default simulation route and deployed agents are one client runtime: the same seed and cohort give the same
model. `fedpar simulate` (worker processes hosting the population) and a real `fedpar serve` with one real
`fedpar client` process per client, each given its member's id and partition and the run's --seed (an agent shuffles
by the seed a member of its id does: client/local_loop.member_seed), run two rounds of digits with every client
sampled; their final global weights agree to float tolerance (only the fold order differs). The default route
(`--client-batching auto`: one by one for this dense model on the CPU) and the stacked route (`--client-batching on`:
the worker's members trained as one torch.func model) both give the deployed model: measured, the two simulated routes
differ by at most 3e-8 (0.15% of the tolerance). The federated evaluation agrees too (a worker scores its members'
validation splits in one pass, each agent its own)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedpar.cli.main import main
from fedpar.server.final_model import load_final_model
from support.deployed_agents import deployed_model

CLIENTS, ROUNDS, SEED = 3, 2, 7
TRAINING = ["--dataset", "digits", "--model", "mlp"]
SPLIT = ["--partition", "iid", "--val-fraction", "0.1"]  # the clients' (and the simulated members') shares
ROUND = ["--rounds", str(ROUNDS), "--clients-per-round", str(CLIENTS), "--overselect", "1.0", "--local-epochs", "1",
         "--batch-size", "32", "--lr", "0.1", "--deadline", "60", "--seed", str(SEED)]


def test_simulate_and_deployed_agents_give_the_same_model_for_the_same_seed_and_cohort(tmp_path):
    routes = {"simulated": [], "stacked": ["--client-batching", "on"]}
    for run, flags in routes.items():
        assert main(["simulate", "--clients", str(CLIENTS), "--workers", "1", "--seats", "2", "--quiet", "--out",
                     str(tmp_path / run), *TRAINING, *SPLIT, *ROUND, *flags]) == 0
    deployed = deployed_model(tmp_path, CLIENTS, SEED, TRAINING, SPLIT, ROUND)
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
