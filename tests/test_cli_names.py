"""Names and help of the command line (issue 17): one meaning per flag, the same defaults for the same knob, options
declared once with TOML errors that name the key, --log-level everywhere, help in sections, a light `fedpar --help`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from fedpar.cli.config import apply_config_defaults
from fedpar.cli.log_level import set_grpc_verbosity
from fedpar.cli.main import build_parser, main, subcommand_parser
from fedpar.cli.subcommands import SUBCOMMANDS
from support.in_process import run_main


def _refused(argv: list[str], capsys) -> str:
    """The one line a refused option prints (argparse's exit code 2)."""
    with pytest.raises(SystemExit, match="2"):
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "simulate"])
def test_dp_is_refused_where_it_meant_privacy_naming_the_new_flags(command, capsys):
    line = _refused([command, "--dp", "central"], capsys)
    assert line == (f"fedpar {command}: error: --dp is gone: differential privacy is --privacy {{off,central,client}} "
                    f"(DDP replicas, on client and train, are --dp-replicate); see 'fedpar {command} --help'")
    assert "is now --privacy-noise" in _refused([command, "--dp-noise", "0.5"], capsys)
    assert "is now --privacy-adaptive-quantile" in _refused([command, "--dp-adaptive-quantile", "0.5"], capsys)


@pytest.mark.parametrize("command", ["train", "client"])
def test_dp_is_refused_where_it_meant_replicas_naming_the_new_flags(command, capsys):
    line = _refused([command, "--dp", "2"], capsys)
    assert "--dp is now --dp-replicate (DDP replicas); differential privacy is --privacy" in line


def test_virtual_clients_is_the_default_now_and_its_flag_or_key_says_so_in_one_line(tmp_path, capsys):
    (tmp_path / "config.toml").write_text("[simulate]\nvirtual_clients = true\n")
    note = ("is the default now (worker processes host the population; only sampled clients get a model and data); "
            "drop it")
    for n, (how, named) in enumerate(((["--virtual-clients"], "--virtual-clients"),
                                      (["--config", str(tmp_path / "config.toml")], "virtual_clients"))):
        assert main(["simulate", "--clients", "4", "--rounds", "1", "--local-epochs", "1", "--quiet", "--out",
                     str(tmp_path / f"run{n}"), *how]) == 0
        assert capsys.readouterr().err.splitlines() == [f"fedpar simulate: note: {named} {note}"]


def test_each_flag_has_one_meaning_and_the_new_names_parse():
    parser = build_parser()
    args = parser.parse_args(["serve", "--privacy", "central", "--privacy-noise", "0.5", "--privacy-population", "9"])
    assert (args.privacy, args.privacy_noise, args.privacy_population) == ("central", 0.5, 9)
    assert parser.parse_args(["train", "--dp-replicate", "2"]).dp_replicate == 2
    assert parser.parse_args(["client", "--agent-id", "a", "--dp-replicate", "2"]).dp_replicate == 2
    for command in SUBCOMMANDS:
        flags = {s for a in subcommand_parser(parser, command)._actions for s in a.option_strings
                 if a.help != "==SUPPRESS=="}
        assert "--dp" not in flags
        assert not ({"--privacy", "--dp-replicate"} <= flags)  # never both meanings in one command


def test_serve_client_and_simulate_share_the_defaults_of_the_same_knob():
    parser = build_parser()
    serve = parser.parse_args(["serve"])
    simulate = parser.parse_args(["simulate"])
    client = parser.parse_args(["client", "--agent-id", "a"])
    for knob in ("local_epochs", "batch_size", "learning_rate", "rounds", "min_reports", "deadline_seconds", "seed",
                 "model", "dataset", "device", "compression", "topk_ratio", "int8_block", "privacy_noise"):
        assert getattr(serve, knob) == getattr(simulate, knob), knob
    for knob in ("model", "dataset", "partition", "val_fraction", "seed", "device", "precision"):
        assert getattr(client, knob) == getattr(simulate, knob), knob


@pytest.mark.parametrize("toml, expected", [
    ('[serve]\nrounds = "ten"\n', "config.toml: rounds: expected an integer, got 'ten'"),
    ("rounds = -1\n", "config.toml: rounds: -1 is out of range: a count must be at least 1"),
    ('[serve]\nlr = "fast"\n', "config.toml: lr: expected a number, got 'fast'"),  # a key may be the flag's name
    ("[serve]\nlr = 0.1\nlearning_rate = 0.2\n", "config.toml: lr and learning_rate are the same option; keep "
                                                 "learning_rate"),
    # QA: was '--strategy-option must be a table or a list of "KEY=VALUE" strings, got [1, 2]', naming no file
    ("[serve]\nstrategy_options = [1, 2]\n", "config.toml: strategy_options: expected a table "
                                            "([serve.strategy_options] with a KEY = VALUE line each), got [1, 2]"),
    # QA: was 'option learning_rate is set twice, in [serve] and in [serve]'
    ("[serve]\nlearning-rate = 0.1\nlearning_rate = 0.2\n", "config.toml: learning-rate and learning_rate in [serve] "
                                                           "are the same option; keep learning_rate"),
    ("learning_rate = 0.1\nlearning-rate = 0.2\n", "config.toml: learning_rate and learning-rate at the top level are "
                                                  "the same option; keep learning_rate"),
    ('[serve]\nlearning_rate = "fast"\n', "config.toml: learning_rate: expected a number, got 'fast'"),
    ("[serve]\nsecure_aggregation = 1\n", "config.toml: secure_aggregation: expected true or false, got 1"),
    ('[serve]\nprivacy = "centre"\n', "config.toml: privacy: expected one of off, central, client, got 'centre'"),
    ('[serve]\ndp = "central"\n', "config.toml: dp: is gone: differential privacy is privacy"),
    ("[serve]\ndp_noise = 0.5\n", "config.toml: dp_noise: is now privacy_noise"),
    ("[serve]\nmax_agent_share = 1.5\n", "config.toml: max_agent_share: 1.5 is out of range: it must be in (0, 1]"),
])
def test_a_config_file_error_names_the_key_in_the_file(tmp_path, capsys, toml, expected):
    path = tmp_path / "config.toml"
    path.write_text(toml)
    assert main(["serve", "--insecure", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1 and "--" not in err.split(expected)[0][-20:]


def test_nested_and_renamed_keys_of_train_are_typed_too(tmp_path, capsys):
    path = tmp_path / "config.toml"
    path.write_text('[train.parallel]\ntp = "2"\n')
    assert main(["train", "--config", str(path)]) == 2
    assert "config.toml: parallel.tp: expected an integer, got '2'" in capsys.readouterr().err
    path.write_text("[train.parallel]\ndp = 2\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "config.toml: parallel.dp: is now dp_replicate (DDP replicas)" in capsys.readouterr().err
    path.write_text('[train]\nout = "x"\ncompile = true\ndp_replicate = 2\ndata_plane = "on"\n')
    assert main(["train", "--config", str(path)]) == 2  # data_plane is serve's
    assert "unknown option(s) for 'train': data_plane" in capsys.readouterr().err


def test_config_values_arrive_typed_as_the_flags_make_them(tmp_path):
    from fedpar.cli.config import apply_config_defaults

    path = tmp_path / "config.toml"
    path.write_text('[serve]\ncheckpoint_dir = "ck"\ndeadline_seconds = 5\ndata_plane = "off"\n'
                    'allow_agents = ["a,b", "c"]\n[client]\ndata_plane = true\n')
    parser = build_parser()
    apply_config_defaults(subcommand_parser(parser, "serve"), ["--config", str(path)], "serve")
    args = parser.parse_args(["serve"])
    assert (str(args.checkpoint_dir), args.deadline_seconds, args.data_plane) == ("ck", 5.0, "off")
    assert isinstance(args.deadline_seconds, float) and args.allow_agents == ["a", "b", "c"]


def test_every_subcommand_takes_log_level(caplog):
    parser = build_parser()
    for command in SUBCOMMANDS:
        action = next(a for a in subcommand_parser(parser, command)._actions if "--log-level" in a.option_strings)
        assert action.choices == ("debug", "info", "warning", "error")
    fedpar_log = logging.getLogger("fedpar")
    try:
        with caplog.at_level(logging.DEBUG):  # pytest's handler takes everything the loggers let through
            assert main(["serve", "--insecure", "--log-level", "error", "--port", "0", "--secure-aggregation", "--strategy",
                         "krum"]) == 2
            assert fedpar_log.level == logging.ERROR and "plaintext" not in caplog.text
            assert main(["serve", "--insecure", "--log-level", "warning", "--port", "0", "--secure-aggregation", "--strategy",
                         "krum"]) == 2
            assert fedpar_log.level == logging.WARNING and "--insecure: plaintext gRPC" in caplog.text
    finally:
        fedpar_log.setLevel(logging.NOTSET)


def test_simulate_log_level_reaches_its_worker_processes(tmp_path, capfd):
    # fedpar simulate's main in this process; capfd holds its processes' stderr, as a subprocess's
    loud = run_main(["simulate", "--clients", "2", "--rounds", "1", "--workers", "1", "--local-epochs", "1", "--out",
                     str(tmp_path / "run"), "--quiet", "--log-level", "info"], capfd)
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert "fedpar.client host-0: coordinator says" in loud.stderr  # its host's line, from the worker process


def test_log_level_debug_turns_on_grpc_debug_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    set_grpc_verbosity(["--log-level", "info"])
    assert os.environ["GRPC_VERBOSITY"] == "ERROR"  # no "Handshake failed" INFO lines of gRPC's C core
    monkeypatch.delenv("GRPC_VERBOSITY")
    set_grpc_verbosity(["--log-level", "debug"])
    assert os.environ["GRPC_VERBOSITY"] == "DEBUG"
    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
    set_grpc_verbosity(["--log-level", "debug"])
    assert os.environ["GRPC_VERBOSITY"] == "ERROR"


@pytest.mark.parametrize("command, sections", [
    ("serve", ["coordinator", "outputs", "data and model", "device", "rounds and sampling", "local training",
               "aggregation", "secure aggregation", "transfer", "limits", "differential privacy", "TLS and identity",
               "observability"]),
    ("simulate", ["rounds and sampling", "data and model", "local training", "simulated clients", "aggregation",
                  "coordinator", "secure aggregation", "device", "outputs", "transfer", "differential privacy",
                  "observability"]),
    ("client", ["connection", "data and model", "device", "TLS and identity", "large-model agent"]),
    ("train", ["data and model", "device", "optimisation", "outputs", "observability", "parallelism"]),
    ("simulate-workers", ["connection", "TLS and identity", "data and model", "simulated clients", "device"]),
    ("certs", ["outputs", "certificates", "revocation and tokens"]),
])
def test_help_is_grouped_into_short_sections(command, sections):
    parser = subcommand_parser(build_parser(only=command), command)
    titles = [g.title for g in parser._action_groups if g._group_actions]
    assert titles[0] == "options" and titles[1:] == sections
    general = {s for a in parser._action_groups[1]._group_actions for s in a.option_strings
               if a.help != "==SUPPRESS=="}  # hidden: the renamed --dp* that refuse themselves
    assert general == {"-h", "--help", "--config", "--debug", "--log-level"}
    assert max(len(g._group_actions) for g in parser._action_groups) <= 25


def test_fedpar_help_and_every_subcommands_help_import_no_torch():
    """`fedpar --help`, building any parser and every `fedpar COMMAND --help` (serve's and simulate's list the
    strategies and their options) run without importing torch (about 2 s of CPU a call)."""
    code = ("import sys\n"
            "from fedpar.cli.main import build_parser, main\n"
            "from fedpar.cli.subcommands import SUBCOMMANDS\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'fedpar --help imported torch'\n"
            "for name in SUBCOMMANDS:\n"
            "    build_parser(only=name)\n"
            "    assert 'torch' not in sys.modules, 'building the parser of ' + name + ' imported torch'\n"
            "    try:\n        main([name, '--help'])\n    except SystemExit:\n        pass\n"
            "    assert 'torch' not in sys.modules, 'fedpar ' + name + ' --help imported torch'\n"
            "print('no torch')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("no torch") and "usage: fedpar" in proc.stdout


@pytest.mark.parametrize("command", ["train", "simulate"])
def test_a_misspelled_table_option_is_named_with_the_one_meant(command, tmp_path, capsys):
    """[train.task_option] (no s) was flattened as options of train, and only its key was said: 'unknown option(s)
    for 'train': csv' (QA)."""
    path = tmp_path / "t3.toml"
    path.write_text(f'[{command}.task_option]\ncsv = "data.csv"\n')
    assert main([command, "--config", str(path)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"fedpar {command}: {path}: unknown option(s) for '{command}': task_option (a table holding "
                     f"csv; did you mean task_options?); run 'fedpar {command} --help' for the valid ones"]


@pytest.mark.parametrize("argv, text, key", [
    (["run", "ls"], 'config = "other.toml"\n', "config"),  # went unread
    (["run", "ls"], "help = true\n", "help"),  # went unread
    (["run"], 'words = "ls"\n', "words"),  # split into letters: "unknown action 'l'"
    (["export"], 'source = "runs/x"\nto = "m.pt"\n', "source"),
])
def test_a_config_file_may_not_set_config_help_or_the_commands_words(argv, text, key, tmp_path, capfd):
    """QA: these keys were taken as options, and went unread or were garbled, saying nothing of the file."""
    path = tmp_path / "c.toml"
    path.write_text(f"[{argv[0]}]\n{text}")
    done = run_main([*argv, "--config", str(path)], capfd, tmp_path)
    assert (done.returncode, done.stderr) == (2, f"fedpar {argv[0]}: {path}: unknown option(s) for '{argv[0]}': "
                                                 f"{key}; run 'fedpar {argv[0]} --help' for the valid ones\n")


def test_a_list_option_given_as_a_flag_replaces_the_config_files_list(tmp_path, capfd):
    """QA: the flag's items were added to the file's: allow_agents = ["a"] with --allow-agents b still let agent a in,
    and agents = ["a"] with 'fedpar certs --agents b' made a's certificate too."""
    path = tmp_path / "c.toml"
    path.write_text('[certs]\nagents = ["a"]\n[serve]\nallow_agents = ["a"]\n')
    done = run_main(["certs", "--config", str(path), "--out", str(tmp_path / "certs"), "--agents", "b"], capfd)
    assert done.returncode == 0 and sorted(p.name for p in (tmp_path / "certs").glob("?.pem")) == ["b.pem"], done
    parser = build_parser(only="serve")
    argv = ["--config", str(path), "--allow-agents=b"]
    apply_config_defaults(subcommand_parser(parser, "serve"), argv, "serve")
    assert parser.parse_args(["serve", *argv]).allow_agents == ["b"]
    parser = build_parser(only="serve")  # without the flag, the file's list
    apply_config_defaults(subcommand_parser(parser, "serve"), argv[:2], "serve")
    assert parser.parse_args(["serve", *argv[:2]]).allow_agents == ["a"]


def test_every_true_false_setting_has_a_no_flag_and_its_help_as_declared():
    """QA: only settings declared negatable had --no-X, so insecure = true or follow = true in a --config file could
    not be turned off on the command line; and argparse's own --X/--no-X put '(default: %(default)s)' into its help
    (twice where the help said its default, and unrendered in the generated reference)."""
    import argparse

    from fedpar.cli.argtypes import Switch

    parser, switches = build_parser(), 0
    for command in SUBCOMMANDS:
        for action in subcommand_parser(parser, command)._actions:
            if not hasattr(action, "setting_site") or action.nargs != 0:
                continue
            switches += 1
            flag = next(s for s in action.option_strings if s.startswith("--"))
            assert isinstance(action, Switch) and f"--no-{flag[2:]}" in action.option_strings, (command, flag)
            assert "%(default)" not in action.help, (command, flag, action.help)
            assert isinstance(action, argparse.BooleanOptionalAction)
    assert switches >= 15


@pytest.mark.parametrize("command, needed", [("serve", []), ("client", ["--agent-id", "a"])])
def test_a_config_files_true_is_turned_off_by_the_no_flag(command, needed, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f"[{command}]\ninsecure = true\n")
    for argv, insecure in ((["--config", str(path)], True), (["--config", str(path), "--no-insecure"], False),
                           (["--no-insecure", "--config", str(path)], False)):
        parser = build_parser(only=command)
        apply_config_defaults(subcommand_parser(parser, command), argv, command)
        assert parser.parse_args([command, *needed, *argv]).insecure is insecure, argv


def test_no_insecure_on_the_command_line_wins_over_the_files_insecure(tmp_path, capfd):
    """The docs say flags override the file: with --no-insecure the agent asks for TLS, as with no file."""
    path = tmp_path / "c.toml"
    path.write_text("[client]\ninsecure = true\n")
    done = run_main(["client", "--config", str(path), "--no-insecure", "--agent-id", "a", "--server",
                     "127.0.0.1:1"], capfd, tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("fedpar client: TLS is required: "), done


@pytest.mark.parametrize("command", ["serve", "simulate"])
def test_a_config_file_key_may_be_the_flags_own_name(command, tmp_path):
    """The guide listed deadline_seconds for --deadline, and deadline = 30 was an unknown option: a setting whose flag
    differs from its name takes either as its key."""
    path = tmp_path / "config.toml"
    path.write_text(f"[{command}]\ndeadline = 30\nlr = 0.05\n")
    parser = build_parser(only=command)
    sub = subcommand_parser(parser, command)
    assert apply_config_defaults(sub, ["--config", str(path)], command) == {"deadline_seconds", "learning_rate"}
    args = parser.parse_args([command])
    assert (args.deadline_seconds, args.learning_rate) == (30.0, 0.05)
