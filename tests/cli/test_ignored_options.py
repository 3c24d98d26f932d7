"""Options a run would have ignored in silence (exit 0) are refused in one line (exit 2) saying what to do instead:
--task-option without --task on simulate (as serve, client and train), fedpar's local training and strategy options
when a Flower App's ServerApp drives, --target-accuracy for a Flower App (nothing evaluates its model centrally);
and an option another command names otherwise is named (train's --data-path for --data-dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpar.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
FLOWER_APP = ["--flower-app", str(ROOT / "examples" / "flower_app"), "--run-config", "num-server-rounds=1",
              "--clients", "3", "--workers", "1"]


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("command", [["simulate", "--clients", "3", "--rounds", "1"], ["train", "--max-steps", "1"]])
def test_a_task_option_without_a_task_is_refused_by_simulate_as_by_train(command, tmp_path, capsys):
    """simulate trained digits and said nothing."""
    assert main([*command, "--task-option", "csv=x", "--out", str(tmp_path)]) == 2
    assert _lines(capsys) == [f"fedpar {command[0]}: --task-option needs --task"]


def test_a_task_options_table_without_a_task_is_a_note_for_simulate(tmp_path, capsys):
    """A file's table is shared by all of a command's uses (cli/config.py ignored_given); typed, it is refused."""
    config = tmp_path / "run.toml"
    config.write_text("[simulate.task_options]\ncsv = \"x\"\n")
    assert main(["simulate", "--config", str(config), "--clients", "3", "--rounds", "1", "--quiet", "--out",
                 str(tmp_path / "o")]) == 0
    assert _lines(capsys)[0] == f"fedpar simulate: note: ignored from {config}: task_options (it needs --task)"


LOCAL_TRAINING = ("the Flower App's ServerApp decides local training (the config of the Messages it sends), so fedpar "
                  "cannot apply {it}; drop {it}, or set {it} in the app's run config (--run-config 'KEY=VALUE', for "
                  "the keys its apps read), or add --strategy NAME to let fedpar drive the app's ClientApps (each "
                  "train Message's config then carries --lr, --local-epochs and --batch-size)")


@pytest.mark.parametrize("option, said", [(["--lr", "0.001"], "--lr"), (["--local-epochs", "4"], "--local-epochs"),
                                          (["--batch-size", "2"], "--batch-size"),
                                          (["--client-eval-every", "2"], "--client-eval-every"),
                                          (["--lr", "0.01", "--batch-size", "2"], "--lr, --batch-size")],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_local_training_is_refused_where_the_server_app_drives(option, said, tmp_path, capsys):
    """The ServerApp's Messages carry its own config: the results were those of a run without the flag."""
    pytest.importorskip("flwr")
    assert main(["simulate", *FLOWER_APP, *option, "--quiet", "--out", str(tmp_path)]) == 2
    it = "it" if "," not in said else "them"
    assert _lines(capsys) == [f"fedpar simulate: {said}: {LOCAL_TRAINING.format(it=it)}"]


def test_a_strategy_option_is_refused_where_the_server_app_drives(tmp_path, capsys):
    pytest.importorskip("flwr")
    assert main(["simulate", *FLOWER_APP, "--strategy-option", "mu=1", "--quiet", "--out", str(tmp_path)]) == 2
    assert _lines(capsys) == ["fedpar simulate: --strategy-option: the Flower App's ServerApp aggregates with its own "
                              "strategy, so fedpar cannot apply it; drop it, or add --strategy NAME to let that fedpar "
                              "strategy (with its options) drive the app's ClientApps"]


def test_a_server_app_s_local_training_from_a_config_file_is_a_note(tmp_path, capsys):
    """A file's table is shared by all of a command's uses (cli/config.py ignored_given); typed, --lr is refused."""
    pytest.importorskip("flwr")
    config = tmp_path / "run.toml"
    config.write_text("[simulate]\nlr = 0.001\n")
    assert main(["simulate", "--config", str(config), *FLOWER_APP, "--quiet", "--out", str(tmp_path / "o")]) == 0
    assert _lines(capsys)[0] == f"fedpar simulate: note: ignored from {config}: lr (the Flower App's ServerApp " \
                                "decides local training)"


@pytest.mark.parametrize("strategy", [[], ["--strategy", "fedavg"]], ids=["server-app", "strategy"])
def test_a_target_accuracy_is_refused_for_a_flower_app(strategy, tmp_path, capsys):
    """Nothing scores a Flower App's model centrally: rounds_to_target was always null."""
    pytest.importorskip("flwr")
    assert main(["simulate", *FLOWER_APP, *strategy, "--target-accuracy", "0.5", "--quiet", "--out",
                 str(tmp_path)]) == 2
    assert _lines(capsys) == ["fedpar simulate: --target-accuracy: fedpar has no central evaluation of a Flower App's "
                              "model (its ClientApps evaluate on their own data), so no round could reach the target; "
                              "drop it"]


@pytest.mark.parametrize("given", [["--data-dir", "/work/shared/data/mnist"], ["--data-dir=/x"]])
def test_train_names_its_data_path_for_a_data_dir(given, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--dataset", "mnist", *given])
    assert exit_.value.code == 2
    assert _lines(capsys) == [f"fedpar train: error: unrecognized arguments: {' '.join(given)} (did you mean "
                              "--data-path?); see 'fedpar train --help'"]


def test_simulate_names_its_data_dir_for_a_data_path(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--dataset", "mnist", "--data-path", "/x"])
    assert exit_.value.code == 2
    assert _lines(capsys) == ["fedpar simulate: error: unrecognized arguments: --data-path /x (did you mean "
                              "--data-dir?); see 'fedpar simulate --help'"]


SERVE_FLOWER_APP = ["serve", "--insecure", "--port", "0", "--flower-app", str(ROOT / "examples" / "flower_app")]


@pytest.mark.parametrize("option, line", [
    (["--lr", "0.001"], f"--lr: {LOCAL_TRAINING.format(it='it')}"),
    (["--strategy-option", "mu=1"], "--strategy-option: the Flower App's ServerApp aggregates with its own strategy, "
                                    "so fedpar cannot apply it; drop it, or add --strategy NAME to let that fedpar "
                                    "strategy (with its options) drive the app's ClientApps"),
    (["--target-accuracy", "0.5"], "--target-accuracy: fedpar has no central evaluation of a Flower App's model (its "
                                   "ClientApps evaluate on their own data), so no round could reach the target; drop "
                                   "it"),
    (["--strategy", "fedavg", "--target-accuracy", "0.5"], "--target-accuracy: fedpar has no central evaluation of a "
                                                           "Flower App's model (its ClientApps evaluate on their own "
                                                           "data), so no round could reach the target; drop it"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_serve_refuses_them_for_a_flower_app_alike(option, line, tmp_path, capsys):
    """serve started the coordinator and waited for agents, ignoring them."""
    pytest.importorskip("flwr")
    assert main([*SERVE_FLOWER_APP, *option, "--out", str(tmp_path)]) == 2
    assert _lines(capsys) == [f"fedpar serve: {line}"]
