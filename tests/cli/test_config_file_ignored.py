"""One rule, cli/config.py ignored_given, for a setting a use of a command would ignore: refused in one line (exit 2)
when its flag was typed; when only a --config file set it, no mistake (a file's table is shared by all of a command's
uses: momentum = 0.9 is for its runs with --optimizer sgd), so the command goes on after one note line naming the
file's key, as 'fedpar run ls' goes on with the file's follow = true. Train refused a file's momentum beside its
optimizer = "adamw" as if --momentum had been typed; simulate a file's secagg_clip without secure aggregation."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.in_process import run_main

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["train", "--max-steps", "1", "--device", "cpu", "--no-plot"]
SIMULATE = ["simulate", "--clients", "3", "--rounds", "1", "--quiet"]


def _fedpar(argv: list[str], cwd: Path, capfd) -> tuple[int, list[str]]:
    """``fedpar ARGV`` by its main in this process, from ``cwd`` (what it and its worker processes write to stderr, as
    a process's): its exit code and its stderr's lines that are not blank."""
    done = run_main(argv, capfd, cwd)
    return done.returncode, [line for line in done.stderr.splitlines() if line.strip()]


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "shared.toml"
    path.write_text(text)
    return path


def test_train_goes_on_past_a_config_files_momentum_its_optimizer_ignores_with_one_note(tmp_path, capfd):
    config = _config(tmp_path, '[train]\noptimizer = "adamw"\nmomentum = 0.9\n')
    code, lines = _fedpar([*TRAIN, "--config", str(config), "--out", "out"], tmp_path, capfd)
    assert (code, lines) == (0, [f"fedpar train: note: ignored from {config}: momentum (it needs --optimizer sgd)"])
    assert (tmp_path / "out" / "global.safetensors").exists()


def test_train_notes_a_config_files_momentum_that_a_typed_optimizer_leaves_unused(tmp_path, capfd):
    config = _config(tmp_path, "[train]\nmomentum = 0.8\n")
    code, lines = _fedpar([*TRAIN, "--config", str(config), "--optimizer", "adamw", "--out", "out"], tmp_path, capfd)
    assert (code, lines) == (0, [f"fedpar train: note: ignored from {config}: momentum (it needs --optimizer sgd)"])


def test_train_still_refuses_a_typed_momentum_its_optimizer_ignores_and_says_no_note(tmp_path, capfd):
    config = _config(tmp_path, '[train]\noptimizer = "adamw"\nmomentum = 0.9\nblock_size = 8\n')
    code, lines = _fedpar([*TRAIN, "--config", str(config), "--momentum", "0.9", "--out", "out"], tmp_path, capfd)
    assert (code, lines) == (2, ["fedpar train: this run would ignore --momentum (it needs --optimizer sgd): drop it, "
                                 "or give what it needs"])
    assert not (tmp_path / "out").exists()


def test_simulate_goes_on_past_a_config_files_secagg_clip_without_secure_aggregation_with_one_note(tmp_path, capfd):
    config = _config(tmp_path, "[simulate]\nsecagg_clip = 1.0\n")
    code, lines = _fedpar([*SIMULATE, "--config", str(config), "--out", "out"], tmp_path, capfd)
    assert (code, lines) == (0, [f"fedpar simulate: note: ignored from {config}: secagg_clip (it needs "
                                 "--secure-aggregation)"])
    assert (tmp_path / "out" / "summary.json").exists()


def test_simulate_says_a_config_files_ignored_keys_in_one_note_once_though_the_run_checks_them_again(tmp_path, capfd):
    """The compression and privacy checks run again as the run is built (for a service's runs): said once."""
    config = _config(tmp_path, "[simulate]\ntopk_ratio = 0.2\nprivacy_noise = 1.2\n")
    code, lines = _fedpar([*SIMULATE, "--config", str(config), "--out", "out"], tmp_path, capfd)
    assert (code, lines) == (0, [f"fedpar simulate: note: ignored from {config}: topk_ratio (it needs --compression "
                                 "topk), privacy_noise (it needs --privacy central or --privacy client)"])


@pytest.mark.parametrize("written, typed, line", [
    ("secagg_clip = 1.0\n", ["--secagg-clip", "1.0"],
     "--secagg-clip applies only with --secure-aggregation; add it (or drop the option)"),
    ('[simulate.task_options]\ncsv = "y"\n', ["--task-option", "csv=x"], "--task-option needs --task"),
])
def test_simulate_still_refuses_the_typed_flag_and_says_no_note(written, typed, line, tmp_path, capfd):
    config = _config(tmp_path, f"[simulate]\n{written}")
    code, lines = _fedpar([*SIMULATE, "--config", str(config), *typed, "--out", "out"], tmp_path, capfd)
    assert (code, lines) == (2, [f"fedpar simulate: {line}"])
    assert not (tmp_path / "out").exists()


def test_an_aggregator_rank_neither_refuses_nor_notes_again_what_the_command_noted(tmp_path, capsys):
    """serve's ranks build the run again from the options the command hands them (cli/serve.py plain_options): a
    file's topk_ratio the command let go with a note was refused there as a run file's."""
    import argparse

    from fedpar.cli.compression_options import compression_from_args
    from fedpar.cli.config import apply_config_defaults, given_settings, refuse_unswitched
    from fedpar.cli.declared import switched_options
    from fedpar.cli.main import build_parser, subcommand_parser
    from fedpar.cli.serve import plain_options

    config = _config(tmp_path, "[serve]\ntopk_ratio = 0.2\n")
    argv = ["--insecure", "--config", str(config)]
    parser = build_parser(only="serve")
    serve = subcommand_parser(parser, "serve")
    from_file = apply_config_defaults(serve, argv, "serve")
    args = parser.parse_args(["serve", *argv])  # as cli/main.py main does
    args._typed = given_settings(serve, argv, frozenset())
    args._given = args._typed | from_file
    refuse_unswitched(args, switched_options(serve))
    assert capsys.readouterr().err.splitlines() == [f"fedpar serve: note: ignored from {config}: topk_ratio (it needs "
                                                    "--compression topk)"]
    assert compression_from_args(argparse.Namespace(**plain_options(args))).method == "none"
    assert capsys.readouterr().err == ""
