"""One simulated federation run in-process, with the metrics row of every round."""

from __future__ import annotations

from fedpar.simulations.runner import SimulationConfig, run_simulation


def simulate_rows(**settings) -> tuple[dict, list[dict]]:
    """Run ``SimulationConfig(**settings)``; its summary and its rows."""
    rows: list[dict] = []
    summary = run_simulation(SimulationConfig(**settings), on_round=rows.append)
    return summary, rows
