"""System traces: the file format round-trips and bad files are refused by name; the generated traces have
FedScale's shapes; availability decides whom the coordinator samples, and a trace's speed slows its clients."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedpar.simulations.runner import SimulationConfig, run_simulation
from fedpar.simulations.traces import DAY_SECONDS, generate_traces, load_traces, online


def test_traces_round_trip_through_csv_and_json_and_bad_files_are_refused(tmp_path):
    traces = generate_traces(50, seed=3)
    for name in ("t.csv", "t.json"):
        traces.save(tmp_path / name)
        again = load_traces(tmp_path / name, 50)
        for a, b in zip(traces._columns(), again._columns()):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    rows = json.loads((tmp_path / "t.json").read_text())
    for bad, says in ((rows[:-1], "no trace for 1 of the 50"), ([{**rows[0], "client": 99}], "outside 0..49"),
                      ([{**rows[0], "upload_mbps": 0}], "link speeds > 0"), ([{"client": 0}], "needs the columns")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=says):
            load_traces(tmp_path / "bad.json", 50)


def test_generated_traces_have_a_long_tail_and_diurnal_windows():
    traces = generate_traces(20_000, seed=0)
    speed = traces.seconds_per_step
    assert np.percentile(speed, 99) > 4 * np.median(speed)  # the slowest devices are several times the median
    assert np.all(traces.upload_mbps < traces.download_mbps)
    hours = traces.available_for / 3600
    assert hours.min() >= 2 and hours.max() <= 18
    share = [traces.available(t).mean() for t in np.linspace(0, DAY_SECONDS, 25)]
    assert 0.3 < min(share) and max(share) < 0.6  # about 10 of 24 hours online, spread over the day
    # a window wrapping past midnight
    assert online(1800.0, np.array([23 * 3600.0]), np.array([7200.0])).tolist() == [True]
    assert online(5400.0, np.array([23 * 3600.0]), np.array([7200.0])).tolist() == [False]


def test_availability_decides_who_is_sampled(tmp_path):
    # 40 clients; only clients 0..9 are ever online, so each round's 10 must be exactly those.
    rows = [{"client": i, "seconds_per_step": 0.0, "download_mbps": 10.0, "upload_mbps": 2.0,
             "available_from": 0.0, "available_for": DAY_SECONDS if i < 10 else 0.0} for i in range(40)]
    (tmp_path / "trace.json").write_text(json.dumps(rows))
    summary = run_simulation(SimulationConfig(clients=40, clients_per_round=10, rounds=3, local_epochs=1,
                                              trace=str(tmp_path / "trace.json"),
                                              deadline_seconds=20, out=str(tmp_path / "run")))
    got = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["failed_rounds"] == 0 and [(r["sampled"], r["reported"]) for r in got] == [(10, 10)] * 3


def test_a_trace_and_the_virtual_clock_need_no_other_flag(tmp_path, capfd):
    from fedpar.cli.main import main

    out = tmp_path / "run"
    assert main(["simulate", "--clients", "60", "--clients-per-round", "4", "--rounds", "2", "--local-epochs", "1",
                 "--trace", "fedscale", "--clock", "virtual", "--quiet", "--log-level", "info",
                 "--out", str(out)]) == 0
    # every worker heard that training was over before the coordinator stopped (a host whose members were all away
    # at the end polls last: it was left retrying a coordinator that was gone, for 30 s, about one run in four)
    assert "coordinator unreachable" not in capfd.readouterr().err
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in got] == ["ok", "ok"] and 0 < got[0]["sim_seconds"] < got[1]["sim_seconds"]
