"""A host finds the members whose availability changed by searching the windows' sorted open and close times
(simulations/traces.py AvailabilityEvents), and finds the same ones a pass over every member finds."""

from __future__ import annotations

import numpy as np

from fedpar.simulations.traces import DAY_SECONDS, AvailabilityEvents, generate_traces, online


def test_the_members_found_by_search_are_those_whose_state_changed():
    traces = generate_traces(5_000, seed=3)
    traces.available_for[:50] = DAY_SECONDS  # always online: never a candidate
    events = AvailabilityEvents(traces.available_from, traces.available_for)
    rng = np.random.default_rng(0)
    day, state = 0.0, online(0.0, traces.available_from, traces.available_for)
    for step in np.concatenate([rng.uniform(0, 900, 300), [DAY_SECONDS * 1.5, 10.0]]):  # wraps past midnight
        maybe = events.between(day, day + step)
        day += step
        now = online(day, traces.available_from, traces.available_for)
        changed = np.flatnonzero(now != state)
        assert set(changed.tolist()) <= set(maybe.tolist())  # nothing that changed is missed
        assert not set(maybe.tolist()) & set(range(50))
        state = now
    assert len(events.between(100.0, 160.0)) < 100  # a minute's changes, not the population
