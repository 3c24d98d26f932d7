"""System traces: the file format round-trips and bad files are refused by name; the generated traces have
FedScale's shapes; availability decides whom the coordinator samples, and a trace's speed slows its clients."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedpar.simulations.runner import SimulationConfig, run_simulation
from fedpar.simulations.traces import COLUMNS, DAY_SECONDS, generate_traces, load_traces, online


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
    assert main(["simulate", "--no-plot", "--clients", "60", "--clients-per-round", "4", "--rounds", "2",
                 "--local-epochs", "1", "--trace", "fedscale", "--clock", "virtual", "--quiet", "--log-level", "info",
                 "--out", str(out)]) == 0
    # every worker heard that training was over before the coordinator stopped (a host whose members were all away
    # at the end polls last: it was left retrying a coordinator that was gone, for 30 s, about one run in four)
    assert "coordinator unreachable" not in capfd.readouterr().err
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in got] == ["ok", "ok"] and 0 < got[0]["sim_seconds"] < got[1]["sim_seconds"]


def _trace(path, opens_at: list[float], lasts: list[float]) -> str:
    """A CSV trace of len(opens_at) clients online daily from ``opens_at`` for ``lasts`` seconds."""
    rows = ["client,seconds_per_step,download_mbps,upload_mbps,available_from,available_for"]
    rows += [f"{i},0.01,10,5,{a},{b}" for i, (a, b) in enumerate(zip(opens_at, lasts))]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_under_the_virtual_clock_simulated_time_moves_on_while_too_few_clients_are_online(tmp_path, capfd):
    """Three of four clients come online an hour into the day: the clock goes there (it used to wait on the real
    clock for the hosts' availability to change, which only simulated time could change, until the 300 s limit)."""
    from fedpar.cli.main import main

    trace = _trace(tmp_path / "late.csv", [3600, 3600, 0, 3600], [7200] * 4)
    out = tmp_path / "run"
    assert main(["simulate", "--no-plot", "--clients", "4", "--rounds", "2", "--local-epochs", "1", "--trace", trace,
                 "--clock", "virtual", "--quiet", "--out", str(out)]) == 0
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["status"], r["reported"]) for r in got] == [("ok", 4), ("ok", 4)]
    assert 3600 <= got[0]["sim_seconds"] < 3600 + 60 + 30  # the first step of the clock past the opening, and a round
    assert got[0]["round_seconds"] < 30


def test_on_the_real_clock_a_round_samples_the_clients_online_and_waits_for_none_offline(tmp_path, capfd):
    """Three of four clients come online an hour into the trace's (real) day: the rounds train the one online at once
    (they waited 300 s for the others, then stopped)."""
    import time

    from support.in_process import run_main

    trace = _trace(tmp_path / "late.csv", [3600, 3600, 0, 3600], [7200] * 4)
    out = tmp_path / "run"
    started = time.monotonic()
    done = run_main(["simulate", "--no-plot", "--clients", "4", "--rounds", "2", "--local-epochs", "1", "--trace",
                     trace, "--quiet", "--out", str(out)], capfd)
    assert done.returncode == 0 and time.monotonic() - started < 60, done.stderr
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["status"], r["sampled"], r["reported"]) for r in got] == [("ok", 1, 1)] * 2


def test_a_trace_that_never_has_enough_clients_online_is_one_line_after_a_simulated_day(tmp_path, capfd):
    import time

    from fedpar.cli.main import main

    trace = _trace(tmp_path / "never.csv", [3600, 3600, 0, 3600], [0, 0, 7200, 0])
    started = time.monotonic()
    assert main(["simulate", "--no-plot", "--clients", "4", "--rounds", "2", "--trace", trace, "--clock", "virtual",
                 "--deadline", "1", "--quiet", "--out", str(tmp_path / "run")]) != 0
    assert time.monotonic() - started < 120  # a simulated day of 1-minute steps, not the 300 s wait for agents
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("fedpar simulate: at most 1 of the 4 clients were online at once over a simulated "
                                "day"), err
    assert "a round needs 4 (simulate: --clients-per-round; serve: --min-available)" in lines[-1], err  # was a field
    assert "Traceback" not in err and "stopped with an error" not in err, err


def test_a_plain_csv_is_read_whole_by_numpy_and_any_other_is_said_row_by_row(tmp_path):
    # a million clients' trace took about 7 s row by row, in the coordinator and again in every worker: a CSV of plain
    # numbers is now read by numpy (about 1 s); the columns in another order and the rows shuffled read the same
    traces = generate_traces(500, seed=3)
    path = tmp_path / "t.csv"
    traces.save(path)
    lines = path.read_text().splitlines()
    order = [5, 0, 2, 1, 4, 3]
    rows = [",".join(line.split(",")[k] for k in order) for line in lines]
    path.write_text("\n".join([rows[0]] + rows[1:][::-1]) + "\n")
    got = load_traces(path, 500)
    for column in COLUMNS[1:]:
        assert np.array_equal(getattr(got, column), getattr(traces, column)), column
    # anything else is read (or refused) row by row, naming the row
    header = ",".join(COLUMNS) + "\n"
    for body, clients, said in [("0,0.01,25,6,0,nan", 1, "entry 1: values must be numbers >= 0"),
                                ("0,0.01,25,6,0,1\n0,0.01,25,6,0,1", 2, "entries 1 and 2 are both client 0"),
                                ("0,0.01,25,6,0,1\n1.5,0.01,25,6,0,1", 2, "entry 2: needs the columns"),
                                ("1,2", 1, "entry 1: needs the columns")]:
        path.write_text(header + body + "\n")
        with pytest.raises(ValueError, match=said):
            load_traces(path, clients)
    path.write_text(header + '"0","0.5",1,1,1,1\n')  # quoted numbers: fine row by row
    assert load_traces(path, 1).seconds_per_step[0] == np.float32(0.5)


def test_a_trace_in_which_no_client_is_ever_online_is_refused_at_once(tmp_path, capfd):
    # QA: on the real clock it printed "clients online by their traces: 0 of 4" every 10 s until Ctrl-C
    from fedpar.cli.main import main

    trace = _trace(tmp_path / "never.csv", [3600] * 4, [0] * 4)
    assert main(["simulate", "--no-plot", "--clients", "4", "--rounds", "1", "--trace", trace, "--quiet",
                 "--out", str(tmp_path / "run")]) == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"fedpar simulate: no client of --trace {trace} is ever online (every available_for is 0); "
                     "give a trace in which some clients are"], lines


def test_a_trace_written_by_hand_with_spaces_after_its_commas_runs(tmp_path, capfd):
    """QA: 'client, seconds_per_step, ...' was refused as a header that does not name the columns (it does)."""
    from support.in_process import run_main

    rows = [", ".join(COLUMNS)] + [f"{i}, 0.01, 10, 5, 0, 86400" for i in range(3)]
    (tmp_path / "by_hand.csv").write_text("\n".join(rows) + "\n")
    done = run_main(["simulate", "--no-plot", "--clients", "3", "--rounds", "1", "--local-epochs", "1", "--quiet",
                     "--trace", "by_hand.csv", "--clock", "virtual", "--out", "o"], capfd, tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["rounds"] == 1


def test_a_run_ends_without_waiting_out_a_day_long_step_of_its_trace(tmp_path, capfd):
    """QA: a client whose trace makes a step last a day slept it out in a plain time.sleep, so the run's end waited
    for its seat a minute (the join's limit: 67 s for a 5 s deadline); its pause now wakes when the run stops. The
    limit below is a guard against that hang, far above the few seconds the run takes."""
    import time

    from support.in_process import run_main

    rows = [",".join(COLUMNS)] + [f"{i},{86400 if i == 0 else 0.001},10,5,0,86400" for i in range(4)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    started = time.monotonic()
    # on the CPU: on a GPU box busy with the suite, the members of its 3 s round had no time left to train there
    done = run_main(["simulate", "--no-plot", "--clients", "4", "--rounds", "1", "--local-epochs", "1", "--deadline",
                     "3", "--quiet", "--trace", "t.csv", "--out", "o", "--device", "cpu"], capfd, tmp_path)
    took = time.monotonic() - started
    assert took < 50, f"the run waited for the slow client's day-long step after its round ended ({took:.0f} s)"
    assert done.returncode == 0 and done.stderr == "", done.stderr
    (row,) = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert (row["sampled"], row["reported"], row["close_reason"]) == (4, 3, "deadline"), row
