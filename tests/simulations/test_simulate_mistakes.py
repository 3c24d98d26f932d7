"""What goes into `fedpar simulate` and what comes out of it, when the input is wrong or unusual: a trace file that is
malformed, hostile or huge, a partition parameter out of range, a damaged MNIST folder, a run of one round or of a
diverged loss. Each mistake is one line naming what to change; what a run writes stays readable."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from fedpar.simulations.traces import COLUMNS, generate_traces, load_traces

HEADER = ",".join(COLUMNS)
GOOD = "0.01,20,5,0,86400"


@pytest.mark.parametrize("name, text, says", [
    ("dup.csv", f"{HEADER}\n0,{GOOD}\n0,{GOOD}\n", "entries 1 and 2 are both client 0"),
    ("frac.json", json.dumps([{"client": 0.5, **dict(zip(COLUMNS[1:], (0.01, 20, 5, 0, 86400)))}]), "whole one"),
    ("true.json", json.dumps([{"client": True, **dict(zip(COLUMNS[1:], (0.01, 20, 5, 0, 86400)))}]), "whole one"),
    ("inf.json", '[{"client": 1e400, "seconds_per_step": 0.01, "download_mbps": 20, "upload_mbps": 5, '
                 '"available_from": 0, "available_for": 86400}]', "whole one"),  # was an OverflowError traceback
    ("sleep.csv", f"{HEADER}\n0,1e30,20,5,0,86400\n", "seconds_per_step at most 86400"),  # slept: OverflowError
    ("f32.csv", f"{HEADER}\n0,0.01,1e39,5,0,86400\n", "at most 3.4e+38"),  # inf once kept as float32
    ("nan.csv", f"{HEADER}\n0,nan,20,5,0,86400\n", "numbers >= 0"),
    ("neg.csv", f"{HEADER}\n0,0.01,20,5,-1,86400\n", "numbers >= 0"),
    ("extra.csv", f"{HEADER}\n0,{GOOD},7\n", "7 values for the header's 6 columns"),
    ("empty.csv", "", "no header row"),
    ("semicolons.csv", "client;seconds_per_step\n0;0.01\n", "first line must name the columns"),
    ("rows.txt", f"{HEADER}\n0,{GOOD}\n",
     "is a CSV (its first line names the columns), read as JSON as a file not named .csv is; name it .csv"),
    ("short.csv", f"{HEADER}\n0,{GOOD}\n", "no trace for 1 of the 2 clients"),
])
def test_a_bad_trace_file_is_one_line_naming_what_is_wrong(tmp_path, name, text, says):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=re.escape(says)) as caught:
        load_traces(tmp_path / name, 2 if name == "short.csv" else 1)
    assert "\n" not in str(caught.value)


def test_a_trace_file_is_read_as_a_spreadsheet_writes_it_and_files_that_cannot_be_traces_are_not_read(tmp_path):
    (tmp_path / "bom.csv").write_text(f"\ufeff{HEADER}\r\n0,{GOOD}\r\n", encoding="utf-8")  # Excel's UTF-8 CSV
    assert load_traces(tmp_path / "bom.csv", 1).seconds_per_step.tolist() == [np.float32(0.01)]
    with open(tmp_path / "huge.csv", "wb") as f:
        f.truncate(1 << 30)  # a sparse 1 GiB file: refused by its size, not read into memory
    with pytest.raises(ValueError, match="holds 1,024 MiB, more than 10 clients' rows can"):
        load_traces(tmp_path / "huge.csv", 10)
    for path, says in ((tmp_path, "is a folder"), (tmp_path / "none.csv", "does not exist"),
                       ("/dev/zero", "is not a regular file")):  # /dev/zero was read until the memory ran out
        with pytest.raises(ValueError, match=says):
            load_traces(path, 1)
    generate_traces(3, seed=1).save(tmp_path / "ok.json")
    assert len(load_traces(tmp_path / "ok.json", 3)) == 3


def test_plots_of_one_round_and_of_a_diverged_round_stay_readable():
    """One round drew ticks at rounds 0.95, 0.96, ...; a loss of 2e5 in one round flattened every other to a line
    at 0; a thousand rounds were blotted out by their markers."""
    from fedpar.simulations.plots import panel_figure, round_series

    one = round_series([{"round": 1, "test_accuracy": 0.5, "train_loss": 1.0}])
    ax = panel_figure("accuracy", one["accuracy"], "t").axes[0]
    ax.figure.canvas.draw()
    assert [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]] == [1.0]
    diverged = round_series([{"round": 1, "train_loss": 2.3e5, "test_loss": 21.0},
                             {"round": 2, "train_loss": 20.0, "test_loss": 8.7}])
    assert panel_figure("loss", diverged["loss"], "t").axes[0].get_yscale() == "log"
    calm = round_series({"round": r, "train_loss": 0.1 + 2.0 / r, "test_accuracy": r / 1000} for r in range(1, 1001))
    assert panel_figure("loss", calm["loss"], "t").axes[0].get_yscale() == "linear"
    assert panel_figure("accuracy", calm["accuracy"], "t").axes[0].lines[0].get_marker() in (None, "None", "")


def test_a_damaged_mnist_folder_is_named_for_what_it_is(tmp_path):
    """A cut-short or text train.npz was said to 'store object arrays, which need pickle'; a --data-dir naming the
    npz file itself was said not to exist."""
    from fedpar.datasets.mnist import load_mnist

    np.savez(tmp_path / "test.npz", x=np.zeros((2, 28, 28), np.uint8), y=np.zeros(2, np.int64))
    (tmp_path / "train.npz").write_bytes((tmp_path / "test.npz").read_bytes()[:100])
    with pytest.raises(ValueError, match="train.npz is not an .npz file .cut short"):
        load_mnist(tmp_path)
    with pytest.raises(ValueError, match="test.npz is a file; point it at the folder that holds it"):
        load_mnist(tmp_path / "test.npz")


def test_simulate_given_a_hostile_trace_says_one_line_and_exits_2(tmp_path, capfd):
    """Through the command: a client id of 1e400 ended in an OverflowError traceback."""
    from support.in_process import run_main

    (tmp_path / "t.json").write_text('[{"client": 1e400, "seconds_per_step": 0.01, "download_mbps": 20, '
                                     '"upload_mbps": 5, "available_from": 0, "available_for": 86400}]')
    done = run_main(["simulate", "--clients", "1", "--rounds", "1", "--trace", str(tmp_path / "t.json"), "--out",
                     str(tmp_path / "out")], capfd)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"fedpar simulate: {tmp_path / 't.json'}, entry 1: needs the columns {', '.join(COLUMNS)}, all numbers "
        "(client a whole one)"]


@pytest.mark.parametrize("name, says", [
    ("synthetic:1", "bad synthetic dataset name 'synthetic:1'; use synthetic:ALPHA:BETA[:CLIENTS[:SAMPLES]]"),
    ("synthetic:iid:x", "bad synthetic dataset name 'synthetic:iid:x'; ALPHA, BETA and SAMPLES are numbers"),
    ("synthetic:-1:1", "synthetic dataset 'synthetic:-1:1' needs CLIENTS >= 1"),
])
def test_simulate_given_a_malformed_synthetic_name_says_one_line_and_exits_2(tmp_path, capfd, name, says):
    """It was a traceback from the worker processes' start (train, serve and client said the line)."""
    from support.in_process import run_main

    done = run_main(["simulate", "--clients", "10", "--rounds", "1", "--dataset", name, "--out",
                     str(tmp_path / "out")], capfd)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedpar simulate: {says}"), lines


@pytest.mark.parametrize("flags, says", [
    (["--model", "gpt"], "model 'gpt' is not an image classifier for this data"),
    (["--dataset", "mnist", "--data-dir", "/nonexistent/mnist"], "MNIST folder /nonexistent/mnist does not exist"),
])
def test_a_refusal_that_needs_the_data_keeps_an_earlier_runs_outputs(tmp_path, capfd, flags, says):
    """A refused command loses nothing: these refusals come once the data is loaded, after the earlier run's files
    were moved out of the way (QA: they were deleted); the next run that goes on replaces them."""
    from support.in_process import run_main

    out = tmp_path / "out"
    out.mkdir()
    earlier = {name: f"{name} of an earlier run\n" for name in ("metrics.jsonl", "global.json", "summary.json")}
    for name, text in earlier.items():
        (out / name).write_text(text)
    done = run_main(["simulate", "--clients", "4", "--rounds", "1", "--out", str(out), *flags], capfd)
    assert done.returncode == 2 and done.stderr.strip().startswith(f"fedpar simulate: {says}"), done.stderr
    assert {p.name: p.read_text() for p in out.iterdir()} == earlier  # and no folder of them left aside
    assert run_main(["simulate", "--clients", "4", "--rounds", "1", "--out", str(out)], capfd).returncode == 0
    assert not [p.name for p in out.iterdir() if p.read_text(errors="replace").endswith("of an earlier run\n")]
    assert not (out / ".earlier-run").exists()
