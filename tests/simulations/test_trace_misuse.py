"""A user's mistake with --trace or the virtual clock is one line and exit 2, before any round (QA)."""

from __future__ import annotations

from support.in_process import run_main

from fedpar.simulations.traces import COLUMNS

SIMULATE = ["simulate", "--clients", "4", "--rounds", "1", "--local-epochs", "1", "--quiet"]


def _refused(argv: list[str], capfd, cwd) -> str:
    """The one line ``fedpar ARGV`` said, run in ``cwd``; it exited 2."""
    done = run_main(argv, capfd, cwd)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_a_link_speed_too_small_for_float32_is_refused_by_its_entry(tmp_path, capfd):
    """QA: a download_mbps of 1e-50 passed the check (> 0), was 0 as float32, and under --clock virtual each worker
    died of a ZeroDivisionError traceback (exit 1)."""
    rows = [",".join(COLUMNS)] + [f"{i},0.01,1e-50,5,0,86400" for i in range(4)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    line = _refused(SIMULATE + ["--trace", "t.csv", "--clock", "virtual", "--out", "o"], capfd, tmp_path)
    assert line == ("fedpar simulate: t.csv, entry 1: values must be numbers >= 0 (at most 3.4e+38), link speeds > 0 "
                    "(at least 1e-06 Mbps), seconds_per_step at most 86400 (a day)"), line


def test_a_json_trace_nested_too_deep_is_refused_as_json_it_cannot_read(tmp_path, capfd):
    """QA: a JSON file of 60,000 '[' (a file mangled, not a trace) ended in a RecursionError traceback (exit 1)."""
    (tmp_path / "t.json").write_text("[" * 60_000)
    line = _refused(SIMULATE + ["--clients", "100", "--trace", "t.json", "--out", "o"], capfd, tmp_path)
    assert line == ("fedpar simulate: cannot read the traces in t.json as JSON (a file not named .csv is read as "
                    "JSON): maximum recursion depth exceeded while decoding a JSON array from a unicode string"), line


def test_a_trillion_clients_with_a_trace_are_refused_by_memory_not_a_memory_error(tmp_path, capfd):
    """QA: with --checkpoint-dir, --clients 10^12 --trace fedscale generated the traces before the population's memory
    was checked: numpy's 'Unable to allocate 7.28 TiB' traceback (exit 1)."""
    line = _refused(SIMULATE + ["--clients", str(10**12), "--clients-per-round", "10", "--trace", "fedscale",
                                "--checkpoint-dir", "ck", "--out", "o"], capfd, tmp_path)
    assert line.startswith("fedpar simulate: a population of 1,000,000,000,000 clients in 2 worker processes needs "
                           "about 279397.7 GiB of memory"), line
    assert not (tmp_path / "ck").exists() and not (tmp_path / "o").exists()


def test_a_csv_trace_named_in_capitals_is_read_as_csv(tmp_path, capfd):
    """QA: T.CSV (as a spreadsheet on Windows names it) was read as JSON: 'cannot read the traces in T.CSV as JSON
    ...: Expecting value: line 1 column 1 (char 0)' (exit 2)."""
    import json

    rows = [",".join(COLUMNS)] + [f"{i},0.01,10,5,0,86400" for i in range(4)]
    (tmp_path / "T.CSV").write_text("\n".join(rows) + "\n")
    done = run_main(SIMULATE + ["--trace", "T.CSV", "--out", "o"], capfd, tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["rounds"] == 1


def test_a_utf16_trace_is_said_to_be_utf16_not_binary(tmp_path, capfd):
    """QA: a CSV saved as UTF-16 (a spreadsheet's "Unicode text") was refused as 'not a text file'."""
    rows = [",".join(COLUMNS)] + [f"{i},0.01,10,5,0,86400" for i in range(4)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n", encoding="utf-16")
    line = _refused(SIMULATE + ["--trace", "t.csv", "--out", "o"], capfd, tmp_path)
    assert line == "fedpar simulate: cannot read the traces in t.csv: it is UTF-16 text; save it as UTF-8", line


def test_a_csv_trace_named_json_says_to_name_it_csv(tmp_path, capfd):
    """QA: a CSV named t.json was refused as JSON: 'Expecting value: line 1 column 1 (char 0)', with no word that it
    was a good CSV."""
    rows = [",".join(COLUMNS)] + [f"{i},0.01,10,5,0,86400" for i in range(4)]
    (tmp_path / "t.json").write_text("\n".join(rows) + "\n")
    line = _refused(SIMULATE + ["--trace", "t.json", "--out", "o"], capfd, tmp_path)
    assert line == ("fedpar simulate: t.json is a CSV (its first line names the columns), read as JSON as a file not "
                    "named .csv is; name it .csv"), line


def test_a_simulate_workers_trace_day_against_a_virtual_clock_is_refused(tmp_path, capfd):
    """QA: simulate-workers --trace-day-seconds 60 against serve --clock virtual ran, its day silently not taken
    (simulate refuses the same flags at once); the host now stops in simulate's line, exit 2 (run by its main in this
    process, against a real serve process)."""
    import re
    import subprocess
    import sys

    rows = [",".join(COLUMNS)] + [f"{i},0.01,10,5,0,86400" for i in range(4)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    fedpar = [sys.executable, "-m", "fedpar"]
    serve = subprocess.Popen(fedpar + ["serve", "--insecure", "--host", "127.0.0.1", "--port", "0", "--rounds", "1",
                                       "--accept-populations", "--clock", "virtual", "--min-available", "4", "--out",
                                       "o"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = re.search(r"listening on (127\.0\.0\.1:\d+)", serve.stdout.readline()).group(1)
        done = run_main(["simulate-workers", "--insecure", "--server", address, "--clients", "4", "--trace", "t.csv",
                         "--trace-day-seconds", "60"], capfd, tmp_path)
    finally:
        serve.kill()
        serve.wait(timeout=30)
    lines = [line for line in done.stderr.splitlines() if "--insecure" not in line]
    assert done.returncode == 2 and lines == [
        "fedpar simulate-workers: --trace-day-seconds: under --clock virtual a trace's days pass in simulated time, "
        "not in real seconds; drop it (or use --clock real)"], done.stderr


DAY_TOO_SHORT = ("--trace-day-seconds {}: a trace day must last at least 2 real seconds (hosts read the trace's clock "
                 "about every 2 s, so a shorter day passes unseen); give a longer one")


def test_a_trace_day_shorter_than_the_hosts_read_it_is_refused(tmp_path, capfd):
    """QA: --trace-day-seconds 1e-9 ran on noise for availability, and 1e-300 overflowed the trace's clock to NaN
    (every member away: 'interrupted after 1 completed round'); a day the hosts cannot see pass is refused."""
    rows = [",".join(COLUMNS)] + [f"{i},0.001,10,5,{i * 20000},40000" for i in range(4)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    for day in ("1e-300", "0.0001", "1.9"):
        line = _refused(SIMULATE + ["--trace", "t.csv", "--trace-day-seconds", day, "--out", "o"], capfd, tmp_path)
        assert line == "fedpar simulate: " + DAY_TOO_SHORT.format(f"{float(day):g}"), line
    assert not (tmp_path / "o").exists()


def test_simulate_workers_refuses_a_trace_day_too_short_before_it_dials(tmp_path, capfd):
    """QA: simulate-workers took --trace-day-seconds 0.001 as simulate did; it now says simulate's line, exit 2,
    before it dials the coordinator (none listens here)."""
    rows = [",".join(COLUMNS)] + [f"{i},0.001,10,5,0,86400" for i in range(4)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    done = run_main(["simulate-workers", "--insecure", "--server", "127.0.0.1:1", "--clients", "4", "--trace", "t.csv",
                     "--trace-day-seconds", "0.001"], capfd, tmp_path)
    lines = [line for line in done.stderr.splitlines() if "--insecure" not in line]
    assert done.returncode == 2 and lines == ["fedpar simulate-workers: " + DAY_TOO_SHORT.format("0.001")], done.stderr
