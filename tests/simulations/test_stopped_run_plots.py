"""A run that ends without finishing, but not by a signal (a service's run stopped by 'fedpar run stop', or failed),
gets its plots, drawn from its whole metrics history (a resumed run's rounds before its restart too); only a
signal's stop leaves none (QA: stopped runs of 'fedpar serve --state' had no accuracy.png or loss.png)."""

from __future__ import annotations

import json

import numpy as np

from fedpar.aggregation import build_strategy
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator
from fedpar.simulations.run_outputs import write_run_outputs

PNG = b"\x89PNG\r\n\x1a\n"


def _row(round_id: int) -> dict:
    return {"round": round_id, "status": "ok", "test_accuracy": 0.2 * round_id, "test_loss": 2.0 / round_id,
            "round_seconds": 0.1, "wall_seconds": 0.1 * round_id}


def _coordinator(out):
    """A coordinator resumed after round 2 (its rows before the restart are in metrics.jsonl), then round 3."""
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(_row(r)) + "\n" for r in (1, 2)))
    coordinator = Coordinator(CoordinatorConfig(rounds=5, min_available=1, metrics_path=out / "metrics.jsonl"),
                              ["t0"], [np.zeros(4, np.float32)], build_strategy("fedavg"))
    coordinator.metrics.resume(2, _row(2), None)
    coordinator.metrics.append(_row(3))
    return coordinator


def test_a_run_stopped_without_a_signal_gets_plots_of_its_whole_history(tmp_path, monkeypatch):
    from fedpar.simulations import plots

    drawn = []
    real = plots.round_plots
    monkeypatch.setattr(plots, "round_plots", lambda rows, title: real(drawn.extend(rows) or drawn, title))
    out = tmp_path / "run"
    outputs = write_run_outputs(out, _coordinator(out), {}, {"interrupted": True}, "run 1 (stopped)", plots=True)
    assert [row["round"] for row in drawn] == [1, 2, 3]
    assert {"accuracy.png", "loss.png"} <= set(outputs.written)
    assert all((out / name).read_bytes()[:8] == PNG for name in ("accuracy.png", "loss.png"))
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3


def test_a_signals_stop_still_leaves_no_plots(tmp_path):
    out = tmp_path / "run"
    outputs = write_run_outputs(out, _coordinator(out), {}, {"interrupted": True}, "run 1")
    assert "accuracy.png" not in outputs.written and not (out / "accuracy.png").exists()
