"""`simulate --clock virtual`: the deadline and first-K act on simulated time. A straggler study run on the virtual
clock counts the same clients, and learns the same models, as the same study waiting in real time, without the
waiting."""

from __future__ import annotations

import pytest

from support.simulation_runs import simulate_rows as _rows


def test_a_straggler_study_on_the_virtual_clock_counts_who_real_time_counts(tmp_path):
    # 6 of 20 clients are slow: not one local step (+2 s) fits a 1.5 s deadline; the fast ones make it easily
    common = dict(clients=20, rounds=2, local_epochs=1, seed=5, slow_fraction=0.3, slow_step_delay=2.0,
                  deadline_seconds=1.5, target_accuracy=0.3)
    _, real = _rows(**common, out=str(tmp_path / "real"))
    summary, virtual = _rows(**common, virtual_clock=True, out=str(tmp_path / "virtual"))
    for r, v in zip(real, virtual):
        # the 6 slow ones missed the deadline (in real or simulated time): silent, not late
        assert (r["sampled"], r["reported"], r["late"], r["silent"]) == \
            (v["sampled"], v["reported"], v["late"], v["silent"]) == (20, 14, 0, 6)
        assert v["train_loss"] == pytest.approx(r["train_loss"], rel=1e-4)  # the same clients' updates
        assert v["test_accuracy"] == pytest.approx(r["test_accuracy"], abs=0.01)
        assert (v["sim_round_seconds"], v["sim_close_reason"]) == (1.5, "deadline")
        assert v["round_seconds"] < r["round_seconds"]  # nobody waited for the stragglers
    assert summary["sim_seconds"] == 3.0 and summary["rounds_to_target"] in (1, 2, None)
    if summary["rounds_to_target"] is not None:
        assert summary["sim_seconds_to_target"] == 1.5 * summary["rounds_to_target"]


def test_a_virtual_client_does_the_steps_that_fit_before_the_deadline_and_no_more():
    import numpy as np

    from fedpar.simulations.population import PopulationSlice
    from fedpar.simulations.traces import Traces

    traces = Traces(seconds_per_step=np.array([0.5, 0.5, 0.5], np.float32),
                    download_mbps=np.array([8.0, 8.0, 8.0], np.float32),
                    upload_mbps=np.array([4.0, 4.0, 4.0], np.float32),
                    available_from=np.array([0.0, 0.0, 100.0], np.float32),
                    available_for=np.array([86_400.0, 4.0, 50.0], np.float32))
    pop = PopulationSlice.of("h", [0, 1, 2], np.full(3, 10), np.zeros(3), traces=traces)
    mb = 1_000_000  # 1 s down at 8 Mbit/s, 2 s up at 4 Mbit/s
    assert pop.work(0, steps=4, model_bytes=mb, clock_seconds=0.0, deadline=60.0, dropped=False) == (4, 5.0)
    # it stops in time for an upload of 1.2x its download plus 0.25 s, as an agent does: 3 steps by 1 + 1.5 s
    assert pop.work(0, steps=4, model_bytes=mb, clock_seconds=0.0, deadline=3.95, dropped=False) == (3, 4.5)
    # ... which its slower uplink misses (the coordinator then counts it late); no step fits at all: no upload
    assert pop.work(0, steps=4, model_bytes=mb, clock_seconds=0.0, deadline=2.0, dropped=False) == (0, -1.0)
    assert pop.work(0, steps=4, model_bytes=mb, clock_seconds=0.0, deadline=60.0, dropped=True) == (0, -1.0)
    offline_first = (0, -1.0)  # its window closes at 4 s, or 150 s, before it is done
    assert pop.work(1, steps=4, model_bytes=mb, clock_seconds=0.0, deadline=60.0, dropped=False) == offline_first
    assert pop.work(2, steps=4, model_bytes=mb, clock_seconds=146.0, deadline=60.0, dropped=False) == offline_first
    assert pop.work(2, steps=4, model_bytes=mb, clock_seconds=120.0, deadline=60.0, dropped=False) == (4, 5.0)
