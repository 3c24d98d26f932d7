"""What the round plots show, read back from the series they are drawn from (issue 17): federated evaluation at
the round of the model it scored, an accuracy axis zoomed to the data, and the loss beside it."""

from __future__ import annotations

from fedpar.simulations.plots import accuracy_limits, plot_rounds, round_series

# The first rounds of `make simulate` (runs/digits/metrics.jsonl): agents of round r score the model they received.
ROWS = [
    {"round": 1, "status": "ok", "train_loss": 2.06, "federated_eval_loss": 2.30, "federated_eval_accuracy": 0.079,
     "test_loss": 1.80, "test_accuracy": 0.731},
    {"round": 2, "status": "ok", "train_loss": 1.45, "federated_eval_loss": 1.82, "federated_eval_accuracy": 0.686,
     "test_loss": 1.10, "test_accuracy": 0.881},
    {"round": 3, "status": "failed", "train_loss": None, "test_loss": 1.10, "test_accuracy": 0.881},
    {"round": 4, "status": "ok", "train_loss": 0.88, "federated_eval_loss": 1.09, "federated_eval_accuracy": 0.893,
     "test_loss": 0.61, "test_accuracy": 0.921},
]


def test_federated_evaluation_is_placed_at_the_round_of_the_model_it_scored():
    accuracy = round_series(ROWS)["accuracy"]
    assert accuracy["central test accuracy"] == ([1, 2, 3, 4], [0.731, 0.881, 0.881, 0.921])
    # round 1's agents scored the initial model (0), round 2's the model of round 1, round 4's that of round 3
    assert accuracy["federated evaluation (clients' validation)"] == ([0, 1, 3], [0.079, 0.686, 0.893])


def test_the_loss_is_plotted_too_and_missing_values_are_left_out():
    loss = round_series(ROWS)["loss"]
    assert loss["train loss (clients' local training)"] == ([1, 2, 4], [2.06, 1.45, 0.88])
    assert loss["central test loss"] == ([1, 2, 3, 4], [1.80, 1.10, 1.10, 0.61])
    assert loss["federated evaluation loss (clients' validation)"] == ([0, 1, 3], [2.30, 1.82, 1.09])
    assert round_series([{"round": 1, "test_accuracy": float("nan")}]) == {"accuracy": {}, "loss": {}}


def test_the_accuracy_axis_zooms_to_the_data():
    low, high = accuracy_limits([0.93, 0.95, 0.97])
    assert 0.85 < low < 0.93 and 0.97 < high <= 1.0
    low, high = accuracy_limits([0.079, 0.921])  # a run from chance to 0.92 spans nearly the whole axis
    assert 0.0 <= low < 0.079 and 0.921 < high <= 1.0


def test_plot_rounds_writes_one_png_per_panel_with_curves(tmp_path):
    assert [p.name for p in plot_rounds(ROWS, tmp_path, "t")] == ["accuracy.png", "loss.png"]
    assert all((tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in ("accuracy.png", "loss.png"))
    (tmp_path / "no-accuracy").mkdir()
    only_loss = plot_rounds([{"round": 1, "train_loss": 1.0}], tmp_path / "no-accuracy", "t")
    assert [p.name for p in only_loss] == ["loss.png"]


def test_a_long_run_plots_from_a_stream_in_bounded_points():
    """A million-round run's rows, read once from a generator (as from metrics.jsonl): every curve keeps at most
    2 x MAX_POINTS evenly spaced points, from the first round to the last."""
    from fedpar.simulations.plots import MAX_POINTS

    rounds = 1_000_000
    rows = ({"round": r, "test_accuracy": r / rounds, "train_loss": 1.0 / r} for r in range(1, rounds + 1))
    series = round_series(rows)
    xs, ys = series["accuracy"]["central test accuracy"]
    assert MAX_POINTS <= len(xs) <= 2 * MAX_POINTS + 1 and xs[0] == 1 and xs[-1] == rounds
    steps = {b - a for a, b in zip(xs[:-2], xs[1:-1])}
    assert len(steps) == 1 and ys[-1] == 1.0  # evenly thinned, and the last value is there
    assert len(series["loss"]["train loss (clients' local training)"][0]) == len(xs)
