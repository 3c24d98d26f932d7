"""Settings of the clients' speed and of a trace's day that a simulation would ignore are refused in one line before
it starts (simulations/runner.py check_client_speeds): each was taken in silence, exit 0."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedpar.cli.main import main
from fedpar.simulations.config import SimulationConfig
from fedpar.simulations.runner import check_client_speeds

BASE = SimulationConfig(clients=4, rounds=1)


@pytest.mark.parametrize("changes, said", [
    (dict(trace="fedscale", slow_fraction=0.5), "--slow-fraction: the trace (--trace) gives each client its own speed"),
    (dict(flower_app="examples/flower_app", slow_fraction=0.5),
     "--slow-fraction: a Flower App's ClientApp trains at its own pace"),
    (dict(trace="fedscale", virtual_clock=True, trace_day_seconds=60.0),
     "--trace-day-seconds: under --clock virtual a trace's days pass in simulated time"),
])
def test_a_speed_or_day_the_run_would_ignore_is_refused(changes, said):
    with pytest.raises(ValueError, match="^" + said.replace("(", r"\(").replace(")", r"\)")):
        check_client_speeds(replace(BASE, **changes))


@pytest.mark.parametrize("changes", [
    dict(slow_fraction=0.5), dict(trace="fedscale", trace_day_seconds=60.0), dict(trace="fedscale", virtual_clock=True),
    dict(flower_app="examples/flower_app", slow_fraction=0.5, virtual_clock=True),  # simulated time counts it
])
def test_where_they_apply_they_are_taken(changes):
    check_client_speeds(replace(BASE, **changes))


def test_simulate_refuses_one_in_one_line_with_exit_2(tmp_path, capsys):
    assert main(["simulate", "--clients", "4", "--rounds", "1", "--trace", "fedscale", "--slow-fraction", "0.5",
                 "--out", str(tmp_path)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["fedpar simulate: --slow-fraction: the trace (--trace) gives each client its own speed; drop one "
                     "of them"], lines
