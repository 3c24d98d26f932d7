"""`fedpar simulate` is a run service that runs one run: its rounds are driven as a service's runs are, and kept in a
run store (server/run_store.py)."""

import json

import pytest

from fedpar.server.run_store import RunStore
from fedpar.simulations.config import SimulationConfig
from fedpar.simulations.runner import run_simulation


@pytest.mark.timeout(120)
def test_a_simulations_run_is_kept_in_the_run_store_round_by_round_as_its_metrics_log_has_it(tmp_path):
    out = tmp_path / "run"
    store = RunStore(tmp_path / "runs.db")  # a file: it keeps every round, not only the last
    try:
        summary = run_simulation(SimulationConfig(dataset="digits", clients=4, rounds=3, workers=2, partition="iid",
                                                  seed=3, out=str(out)), store=store)
        [run] = store.runs()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2, 3] and summary["rounds"] == 3
        assert store.round_metrics(run.id) == rows  # every row, as the metrics log has it
        assert (run.name, run.status, run.round, run.last_metrics) == ("simulate", "finished", 3, rows[-1])
        assert run.out_dir == str(out) and run.model_path == str(out / "global.safetensors")
        assert run.settings["clients"] == 4 and run.settings["rounds"] == 3  # the run is the simulation's settings
        assert "interrupted" not in summary and "summary.json" in summary["written"]
    finally:
        store.close()
