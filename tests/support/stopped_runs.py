"""What a service's stopped run recorded, checked to agree: its reason, its round in the store, its last metrics row,
its summary and its model (a stop that cut the last round's writing left them a round apart)."""

from __future__ import annotations

import json
from pathlib import Path

from fedpar.server.run_store import RunStore


def assert_stopped_as_recorded(store: RunStore, run_id: int):
    """The stopped run ``run_id`` of ``store``, once its reason, round, last row, summary and model name one round."""
    run = store.get(run_id)
    rows = [row["round"] for row in store.round_metrics(run_id)]
    summary = json.loads((Path(run.out_dir) / "summary.json").read_text())
    model = json.loads((Path(run.out_dir) / "global.json").read_text())
    # before: 'stopped after round N' where ls, the rows, the summary or the model said N + 1
    assert run.reason == f"stopped after round {run.round}", (run.reason, run.round, rows[-3:])
    assert rows[-1] == run.round == summary["rounds"] == model["round"], (rows[-1], run.round, summary, model)
    return run
