"""Progress of long runs (cli/progress.py): on a terminal a bar with the round of all, the last accuracy and the time
left; elsewhere the per-round table's plain lines, whose last column is the time left."""

from __future__ import annotations

import io

from fedpar.cli.progress import COLUMNS, LiveBar, RoundPace, RoundTable, StepBar, time_left


class _Terminal(io.StringIO):
    """What rich writes to a terminal, kept as text."""

    def isatty(self) -> bool:
        return True


def test_time_left_is_the_mean_pace_times_the_steps_to_go():
    assert time_left(0, 10, 5.0) == "?"
    assert time_left(1, 3, 30.0) == "1m00s"
    assert time_left(5, 10, 10.0) == "10s"
    assert time_left(10, 10, 99.0) == "0s"
    assert time_left(1, 101, 36.0 * 2) == "2h00m"


def test_the_tables_plain_lines_end_with_the_time_left():
    out = io.StringIO()
    table = RoundTable(total=3, stream=out)
    for round_id in (1, 2, 3):
        table.row({"round": round_id, "status": "ok", "test_accuracy": 0.5 + round_id / 10})
    header, *rows = out.getvalue().splitlines()
    assert header.split()[-1] == "left" and header.split()[:2] == ["round", "status"]
    assert [row.split()[0] for row in rows] == ["1/3", "2/3", "3/3"]
    assert rows[0].endswith(" " * len("left"))  # one round ended: no pace to go by yet
    assert all(row.split()[-1].endswith("s") for row in rows[1:]) and rows[-1].split()[-1] == "0s"
    assert rows[-1].split()[len(COLUMNS) - 3] == "0.8000"  # test_accuracy, as the row gave it


def test_the_table_stays_aligned_for_a_thousand_rounds():
    """'1/1000' is wider than the header's 'round': it shifted every later column of every row."""
    out = io.StringIO()
    table = RoundTable(total=1000, stream=out)
    for round_id in (1, 999, 1000):
        table.row({"round": round_id, "status": "ok", "test_accuracy": float("nan")})
    header, *rows = out.getvalue().splitlines()
    assert {len(row) for row in rows} == {len(header)}
    assert [row.index(" ok") + 3 for row in rows] == [header.index("status") + 6] * 3


def test_the_time_left_goes_by_the_rounds_after_the_first_not_the_start_up():
    now = [0.0]
    pace = RoundPace(10, clock=lambda: now[0])
    said = []
    for end in (30.0, 31.0, 32.0, 33.0):  # 30 s of start-up (data, clients joining), then 1 s rounds
        now[0] = end
        pace.note(len(said) + 1)
        said.append(pace.left())
    assert said == ["", "8s", "7s", "6s"]  # it said 4m30s after round 1 (30 s a round) and 2m04s after round 2
    now[0] = 33.5
    assert pace.left() == "7s"  # mid-round: the 3.5 s since round 1 ended, over 3 rounds, times 6 to go
    finished = RoundPace(1, clock=lambda: now[0])
    finished.note(1)
    assert finished.left() == "0s"


def test_a_quiet_table_prints_nothing():
    out = io.StringIO()
    RoundTable(total=2, stream=out, quiet=True).row({"round": 1, "status": "ok"})
    assert out.getvalue() == ""


def test_the_bar_shows_the_round_of_all_the_last_accuracy_and_the_time_left_on_a_terminal_only():
    terminal, pipe = _Terminal(), io.StringIO()
    bars = [LiveBar(stream=terminal, total=5), LiveBar(stream=pipe, total=5)]
    for bar in bars:
        bar.round(1, 0, 4, 30.0)
        bar.round_ended({"round": 1, "status": "ok", "test_accuracy": 0.9123})
        bar.round(2, 3, 4, 12.0)
        bar.round_ended({"round": 2, "status": "ok", "test_accuracy": 0.9123})
        bar.round(3, 1, 4, 5.0)
        bar.close()
    shown = terminal.getvalue()
    assert "round 1/5: uploads accepted" in shown and "left" not in shown.split("round 2/5")[0]  # no pace yet
    assert "round 2/5: uploads accepted" in shown and "3/4" in shown and "deadline in 12 s" in shown
    assert "acc 0.9123" in shown and "s left" in shown.split("round 3/5")[1]  # two rounds ended: a pace
    assert pipe.getvalue() == ""  # not a terminal: the table's lines are the progress


def test_clients_joining_show_as_plain_lines_off_a_terminal_when_their_count_changed():
    pipe, table_stream = io.StringIO(), io.StringIO()
    bar = LiveBar(stream=pipe, plain=table_stream, plain_every=0.0, total=3)
    for registered in (0, 0, 4, 10):
        bar.joining(registered, 10)
    lines = table_stream.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["clients joining: 0 of 10", "clients joining: 4 of 10",
                                                       "clients joining: 10 of 10"]
    assert pipe.getvalue() == ""  # no bar off a terminal
    quiet = io.StringIO()
    LiveBar(stream=io.StringIO(), plain=quiet, plain_every=0.0, quiet=True).joining(3, 10)
    assert quiet.getvalue() == ""  # --quiet: only the summary
    traced = io.StringIO()  # with traces every client may have joined while none is online: said as such
    LiveBar(stream=io.StringIO(), plain=traced, plain_every=0.0, traced=True).joining(0, 1)
    assert traced.getvalue().startswith("clients online by their traces: 0 of 1 (")
    terminal_plain = io.StringIO()
    bar = LiveBar(stream=_Terminal(), plain=terminal_plain, plain_every=0.0)
    bar.joining(3, 10)
    bar.close()
    assert terminal_plain.getvalue() == ""  # a terminal has the bar


def test_the_step_bar_shows_the_step_of_all_and_the_loss_on_a_terminal_and_only_the_lines_elsewhere():
    terminal, pipe = _Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        bar = StepBar(stream=stream)
        bar.step(3, 10, "loss 0.4321")
        bar.line("epoch 0 step 3/10 loss 0.4321, about 7 s left")
        bar.step(10, 10, "loss 0.1234")
        bar.close()
    assert "steps" in terminal.getvalue() and "3/10" in terminal.getvalue() and "loss 0.4321" in terminal.getvalue()
    assert "epoch 0 step 3/10" in terminal.getvalue()  # the trainer's line, above the bar
    assert pipe.getvalue() == "epoch 0 step 3/10 loss 0.4321, about 7 s left\n"


def test_a_set_up_step_shows_on_the_bar_on_a_terminal_and_as_a_plain_line_elsewhere():
    terminal, pipe, plain, quiet_plain = _Terminal(), io.StringIO(), io.StringIO(), io.StringIO()
    LiveBar(stream=terminal, plain=io.StringIO()).preparing("loading mnist")
    LiveBar(stream=pipe, plain=plain).preparing("loading mnist")
    LiveBar(stream=pipe, plain=quiet_plain, quiet=True).preparing("loading mnist")
    assert "loading mnist" in terminal.getvalue()
    assert plain.getvalue() == "loading mnist ...\n" and quiet_plain.getvalue() == ""


def test_a_round_that_ended_is_never_drawn_again():
    terminal = _Terminal()
    bar = LiveBar(stream=terminal, total=3)
    bar.round(2, 0, 4, 60.0)
    bar.round_ended({"round": 2, "status": "ok", "test_accuracy": 0.8806})
    drawn = terminal.getvalue()
    bar.round(2, 0, 4, 60.0)  # the bar's thread read round 2 open just before it ended, and draws it now
    assert terminal.getvalue() == drawn  # no stale bar over round 2's row
    bar.round(3, 0, 4, 60.0)
    bar.close()
    assert "round 3/3" in terminal.getvalue()[len(drawn):]


def test_a_table_row_is_printed_with_the_bar_taken_down_before_it():
    terminal = _Terminal()
    bar, table = LiveBar(stream=terminal, total=3), RoundTable(total=3, stream=terminal)
    bar.round(1, 0, 4, 60.0)
    bar.round_ended({"round": 1, "status": "ok", "test_accuracy": 0.8806})
    bar.round(2, 0, 4, 60.0)  # round 2 opened before round 1's row was printed (the rows come after the next deal)
    table.row({"round": 1, "status": "ok", "sampled": 4, "reported": 4, "test_accuracy": 0.8806})
    shown = terminal.getvalue()
    row = shown.rstrip("\n").rsplit("\n", 1)[1]
    assert row.split()[:2] == ["1/3", "ok"] and shown.endswith(row + "\n")
    assert "\x1b[2K" in shown[shown.rindex("round 2/3"):shown.rindex(row)]  # the bar erased before the row
    bar.round(2, 1, 4, 50.0)  # and drawn again below it
    bar.close()
    assert "round 2/3" in terminal.getvalue()[len(shown):]


def test_the_step_bar_on_standard_output_moves_past_its_first_step(monkeypatch):
    """Once the bar is up, rich puts its proxy (no terminal) in sys.stdout: the bar stayed at step 1 of the run."""
    monkeypatch.setattr("sys.stdout", _Terminal())
    bar = StepBar()
    bar.step(1, 3, "loss 0.9000")
    bar.step(2, 3, "loss 0.5000")
    task = bar._progress.tasks[0]
    assert (task.completed, task.fields["note"]) == (2, "loss 0.5000")
    bar.close()
