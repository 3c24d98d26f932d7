"""A resume of `fedpar simulate --checkpoint-dir D --out O` after another run wrote into O: O's rows are that other
run's, and the resume appended its rounds after them (metrics.jsonl and metrics.csv then held the other run's first
rounds and this run's later ones, and the plots drew them as one run). It is refused in one line, exit 2, and O keeps
the other run's files as they were; resumed into another --out, the run starts there at its checkpoint's round, taking
none of the other run's rows from O."""

from __future__ import annotations

import json

from support.in_process import run_main

COMMON = ["simulate", "--dataset", "digits", "--clients", "2", "--local-epochs", "1", "--quiet", "--out", "O"]


def test_a_resume_into_an_out_whose_rows_another_run_wrote_is_refused_keeping_them(tmp_path, capfd):
    made = run_main([*COMMON, "--rounds", "1", "--checkpoint-dir", "D"], capfd, tmp_path)
    assert made.returncode == 0, made.stderr
    first = json.loads((tmp_path / "O" / "metrics.jsonl").read_text())
    other = run_main([*COMMON, "--rounds", "2", "--lr", "0.5"], capfd, tmp_path)  # another experiment, same --out
    assert other.returncode == 0, other.stderr
    out = tmp_path / "O"
    kept = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "metrics.csv", "summary.json")}
    resumed = run_main([*COMMON, "--rounds", "3", "--checkpoint-dir", "D"], capfd, tmp_path)
    assert resumed.returncode == 2, resumed.stderr
    assert resumed.stdout == "" and "Traceback" not in resumed.stderr
    [line] = resumed.stderr.splitlines()
    assert line.startswith("fedpar simulate: cannot resume: --out O holds another run's rows (metrics.jsonl: its round 1 "
                           "is not the one the checkpoint was made after in --checkpoint-dir D); resume into another "
                           "--out, or move O's files away"), line
    assert {name: (out / name).read_bytes() for name in kept} == kept
    elsewhere = run_main([*COMMON[:-1], "O2", "--rounds", "3", "--checkpoint-dir", "D"], capfd, tmp_path)
    assert elsewhere.returncode == 0, elsewhere.stderr
    rows = [json.loads(line) for line in (tmp_path / "O2" / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [1, 2, 3] and rows[0] == first
    assert {name: (out / name).read_bytes() for name in kept} == kept
