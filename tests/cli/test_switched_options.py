"""Options that apply only under a switch (--secagg-* under --secure-aggregation, --privacy-* under --privacy,
--topk-ratio/--int8-block under their --compression) are refused, one line and exit 2, when the switch is off."""

from __future__ import annotations

import pytest

from fedpar.cli.main import main


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("command", ["simulate", "serve"])
@pytest.mark.parametrize("option", [["--secagg-clip", "0.5"], ["--secagg-max-weight", "10"],
                                    ["--secagg-stage-seconds", "5"]])
def test_a_secagg_option_without_secure_aggregation_is_refused(command, option, capsys):
    """They were ignored in silence (exit 0): a user who set a clip believes the updates are masked."""
    extra = ["--insecure", "--port", "0"] if command == "serve" else ["--quiet"]
    assert main([command, *option, "--rounds", "1", *extra]) == 2
    assert _lines(capsys) == [f"fedpar {command}: {option[0]} applies only with --secure-aggregation; add it (or drop "
                              "the option)"]


def test_an_option_given_at_its_default_value_is_refused_too(capsys):
    """--privacy-noise 1.0 is its default: it was taken for 'not set', and the run was not private."""
    assert main(["simulate", "--privacy-noise", "1.0", "--rounds", "1", "--quiet"]) == 2
    assert _lines(capsys) == ["fedpar simulate: --privacy-noise applies only with --privacy central or --privacy "
                              "client; add one of them (or drop the option)"]


def test_a_config_file_key_without_its_switch_is_said_in_a_note_and_the_command_goes_on(tmp_path, capsys):
    """A file's table is shared by all of a command's uses (cli/config.py ignored_given): the next check here, the
    --out that is a file, is the refusal."""
    config = tmp_path / "run.toml"
    config.write_text("[simulate]\nsecagg_clip = 1.0\n")
    (tmp_path / "a-file").write_text("")
    assert main(["simulate", "--config", str(config), "--rounds", "1", "--quiet", "--out", str(tmp_path / "a-file")]) \
        == 2
    lines = _lines(capsys)
    assert lines[0] == f"fedpar simulate: note: ignored from {config}: secagg_clip (it needs --secure-aggregation)"
    assert len(lines) == 2 and "is a file, not a folder" in lines[1], lines


def test_with_its_switch_the_option_is_taken(capsys):
    """Refused for another reason (one client cannot hide in a sum), not for the clip."""
    assert main(["simulate", "--secure-aggregation", "--secagg-clip", "0.5", "--clients", "1", "--quiet"]) == 2
    lines = _lines(capsys)
    assert len(lines) == 1 and "applies only with" not in lines[0] and "secure aggregation" in lines[0]


# Options whose feature another setting turns on by being given (a trace, a slow share, adaptive clipping, a folder
# dataset, the virtual clock): each was ignored in silence (exit 0) while its siblings were refused.
UNSWITCHED = [
    (["--trace-day-seconds", "60"], "--trace-day-seconds applies only with --trace; add it (or drop the option)"),
    (["--round-wall-timeout", "10"], "--round-wall-timeout applies only with --clock virtual; add it (or drop the "
                                     "option)"),
    (["--clock", "real", "--round-wall-timeout", "10"], "--round-wall-timeout applies only with --clock virtual; add "
                                                        "it (or drop the option)"),
    (["--slow-step-delay", "0.1"], "--slow-step-delay applies only with --slow-fraction; add it (or drop the option)"),
    (["--slow-fraction", "0", "--slow-step-delay", "0.1"], "--slow-step-delay applies only with --slow-fraction; add "
                                                           "it (or drop the option)"),
    (["--privacy", "central", "--privacy-clip-lr", "0.5"], "--privacy-clip-lr applies only with "
                                                           "--privacy-adaptive-quantile; add it (or drop the option)"),
    (["--privacy", "central", "--privacy-count-noise", "2"], "--privacy-count-noise applies only with "
                                                             "--privacy-adaptive-quantile; add it (or drop the "
                                                             "option)"),
    (["--privacy-clip-lr", "0.5"], "--privacy-clip-lr applies only with --privacy central or --privacy client; add "
                                   "one of them (or drop the option)"),  # the section's switch is said first
    (["--data-dir", "/nonexistent"], "--data-dir applies only with --dataset mnist, not digits: the other datasets "
                                     "are bundled, generated or read from the path their name gives; use --dataset "
                                     "mnist (or drop the option)"),
    (["--dataset", "synthetic:1:1", "--data-dir", "/nonexistent"], "--data-dir applies only with --dataset mnist, not "
                                                                   "synthetic:1:1: the other datasets are bundled, "
                                                                   "generated or read from the path their name "
                                                                   "gives; use --dataset mnist (or drop the option)"),
]


@pytest.mark.parametrize("option, line", UNSWITCHED, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_an_option_whose_switch_is_a_given_value_is_refused_without_it(option, line, tmp_path, capsys):
    assert main(["simulate", "--clients", "3", "--rounds", "1", *option, "--quiet", "--out", str(tmp_path)]) == 2
    assert _lines(capsys) == [f"fedpar simulate: {line}"]


@pytest.mark.parametrize("key, value, flag", [("trace_day_seconds", "60.0", "--trace-day-seconds"),
                                              ("round_wall_timeout", "10.0", "--round-wall-timeout"),
                                              ("slow_step_delay", "0.1", "--slow-step-delay"),
                                              ("data_dir", '"/nonexistent"', "--data-dir")])
def test_a_config_file_key_whose_switch_is_a_given_value_is_a_note_without_it(key, value, flag, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(f"[simulate]\n{key} = {value}\n")
    (tmp_path / "a-file").write_text("")
    assert main(["simulate", "--config", str(config), "--rounds", "1", "--quiet", "--out", str(tmp_path / "a-file")]) \
        == 2
    lines = _lines(capsys)
    assert lines[0].startswith(f"fedpar simulate: note: ignored from {config}: {key} (it needs "), lines
    assert len(lines) == 2 and "is a file, not a folder" in lines[1], lines
    assert main(["simulate", "--config", str(config), flag, value.strip('"'), "--rounds", "1", "--quiet"]) == 2
    lines = _lines(capsys)  # typed, it is refused
    assert len(lines) == 1 and lines[0].startswith(f"fedpar simulate: {flag} applies only with "), lines


@pytest.mark.parametrize("command", [["serve", "--insecure", "--port", "0"], ["client", "--insecure", "--agent-id",
                                                                              "a"]])
def test_serve_and_client_refuse_a_data_dir_their_dataset_does_not_read(command, capsys):
    assert main([*command, "--data-dir", "/nonexistent"]) == 2
    assert _lines(capsys) == [f"fedpar {command[0]}: --data-dir applies only with --dataset mnist, not digits: the "
                              "other datasets are bundled, generated or read from the path their name gives; use "
                              "--dataset mnist (or drop the option)"]


def test_a_services_data_dir_is_its_runs_default_and_not_refused(tmp_path, capsys):
    """serve --state --data-dir DIR: each run's TOML says its dataset (review: refused for the service's own default
    digits). Refused here for another reason, its control port's missing certificates."""
    assert main(["serve", "--state", str(tmp_path / "s.db"), "--insecure", "--port", "0", "--data-dir",
                 "/nonexistent"]) == 2
    lines = _lines(capsys)
    assert len(lines) == 1 and "needs mutual TLS" in lines[0] and "applies only with" not in lines[0], lines


@pytest.mark.parametrize("option", [["--trace", "fedscale", "--trace-day-seconds", "60"],
                                    ["--clock", "virtual", "--round-wall-timeout", "10"],
                                    ["--slow-fraction", "0.5", "--slow-step-delay", "0.1"],
                                    ["--privacy", "central", "--privacy-adaptive-quantile", "0.5",
                                     "--privacy-clip-lr", "0.5"],
                                    ["--dataset", "mnist", "--data-dir", "/nonexistent"]],
                         ids=lambda v: " ".join(v))
def test_with_its_given_switch_the_option_is_taken(option, tmp_path, capsys):
    """Refused for another reason (one client cannot hide in a sum), not for the option."""
    assert main(["simulate", *option, "--secure-aggregation", "--clients", "1", "--quiet", "--out",
                 str(tmp_path)]) == 2
    lines = _lines(capsys)
    assert len(lines) == 1 and "applies only with" not in lines[0], lines
