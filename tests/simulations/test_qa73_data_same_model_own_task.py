"""A user's own --task learns the same model under `fedpar simulate` as under `fedpar serve` with one real `fedpar
client` per member, each given only the run's --seed, its member's id and its share: a simulated member shuffled its
batches by seed + crc32(id) while a deployed agent shuffled by --seed itself, so the two routes' models differed
(measured 0.08 at most, after two rounds of examples/own_task.py). Both now take the member's seed from one function
(client/local_loop.member_seed); measured 9e-8 apart (only the fold order differs). With dropout the masks came from
each process's torch stream (a simulated member's depended on what its seat trained before): each member now draws
from its own stream of the round (client/local_loop.member_draws)."""

from __future__ import annotations

import json

import numpy as np

from fedpar.cli.main import main
from fedpar.server.final_model import load_final_model
from support.deployed_agents import deployed_model
from support.own_task import EXAMPLE, write_table

CLIENTS, ROUNDS, SEED = 3, 2, 7
SPLIT = ["--partition", "iid", "--val-fraction", "0.1"]
ROUND = ["--rounds", str(ROUNDS), "--clients-per-round", str(CLIENTS), "--overselect", "1.0", "--local-epochs", "1",
         "--batch-size", "8", "--lr", "0.01", "--deadline", "60", "--seed", str(SEED)]


def test_a_users_task_simulated_and_deployed_gives_the_same_model_for_the_same_seed_and_cohort(tmp_path):
    training = ["--task", EXAMPLE, "--task-option", f"csv={write_table(tmp_path / 'table.csv')}",
                "--task-option", "hidden=8", "--task-option", "dropout=0.3"]  # AdamW over shuffled batches of 8:
    # the order of the batches counts, and so do the dropout masks (each member's own stream of the round)
    assert main(["simulate", "--clients", str(CLIENTS), "--workers", "1", "--seats", "2", "--quiet", "--out",
                 str(tmp_path / "simulated"), *training, *SPLIT, *ROUND]) == 0
    deployed = deployed_model(tmp_path, CLIENTS, SEED, training, SPLIT, ROUND)
    for run in ("simulated", "deployed"):  # every member's update in every round
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [(r["round"], r["status"], r["reported"]) for r in rows] == \
            [(i, "ok", CLIENTS) for i in range(1, ROUNDS + 1)], (run, rows)
    simulated = load_final_model(tmp_path / "simulated")[1]
    assert len(simulated) == len(deployed)
    for got, want in zip(deployed, simulated):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
