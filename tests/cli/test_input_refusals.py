"""Inputs that gave a traceback, an internal name, a raw errno line or nothing at all, each refused by the real
command in one line saying what to do, with a non-zero exit: a synthetic dataset too big for the memory (worker
tracebacks), a --num-partitions the data cannot give (named the zoo's task), a missing --run-config file ('[Errno 2]
...'), a --strategy-option or --task-option key given twice (the last kept in silence), and top-level keys beside a
--config file's table of the command (ignored in silence)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.in_process import run_main

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ["client", "--insecure", "--agent-id", "a", "--server", "127.0.0.1:1", "--give-up-after", "1"]


def _one_line(err: str, expected: str) -> str:
    """The stderr line holding ``expected``; no traceback anywhere."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if expected in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("name, size", [("synthetic:1:1:100000000000:5", "100,000,000,000 clients of about 5"),
                                        ("synthetic:iid:10:1e12", "10 clients of about 1e+12")])
def test_a_synthetic_dataset_too_big_for_the_memory_is_refused_before_any_worker_starts(tmp_path, name, size,
                                                                                         capfd):
    """Each worker process loaded the federation and died with a MemoryError traceback, as did the coordinator."""
    out = tmp_path / "run"
    # its main in this process: what its workers would print reaches the same stderr (capfd)
    done = run_main(["simulate", "--dataset", name, "--clients", "2", "--rounds", "1", "--out", str(out)], capfd,
                    tmp_path)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr, "GiB of memory")
    assert line.startswith(f"fedpar simulate: --dataset {name.replace('1e12', '1e+12')} ({size} examples in 3 "
                           "processes) needs about "), line
    form = "synthetic:iid:CLIENTS:SAMPLES" if "iid" in name else "synthetic:ALPHA:BETA:CLIENTS:SAMPLES"
    assert line.endswith(f"; give fewer CLIENTS (or --clients) or a smaller SAMPLES ({form})"), line
    assert done.stderr.strip() == line and not out.exists()


def test_a_synthetic_dataset_too_big_is_one_line_on_serve_and_client_too(tmp_path, capfd):
    name = "synthetic:1:1:100000000000:5"
    for argv in (["serve", "--insecure", "--port", "0", "--out", str(tmp_path / "s")], CLIENT):
        done = run_main([*argv, "--dataset", name], capfd, tmp_path)
        assert done.returncode == 2, done.stderr
        _one_line(done.stderr, f"fedpar {argv[0]}: --dataset {name} (100,000,000,000 clients of about 5 examples) "
                               "needs about 3725.3 GiB of memory")


def test_a_synthetic_dataset_pooled_by_every_process_is_refused_when_the_pools_do_not_fit(tmp_path, capfd):
    """A partition other than natural pools every client's examples in each process; it was checked one process at
    a time, once every worker had started."""
    name = "synthetic:1:1:10000000:100"
    done = run_main(["simulate", "--dataset", name, "--clients", "10000000", "--partition", "iid", "--out",
                     str(tmp_path / "run")], capfd, tmp_path)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr, "GiB of memory")
    assert line.startswith(f"fedpar simulate: --dataset {name} (10,000,000 clients of about 100 examples in 3 "
                           "processes, pooled for --partition iid) needs about "), line
    assert line.endswith(", or use --partition natural (each client its own examples)"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_synthetic_dataset_of_no_finite_size_is_refused(tmp_path, capfd, value):
    """'nan' passed every check (nan <= 0 is false) and reached numpy."""
    done = run_main(["simulate", "--dataset", f"synthetic:1:1:5:{value}", "--out", str(tmp_path / "s")], capfd)
    assert done.returncode == 2
    _one_line(done.stderr, "needs CLIENTS >= 1 (or --clients), ALPHA and BETA in 0..1000 and SAMPLES > 0 "
                             "(finite numbers)")


def test_the_memory_a_synthetic_federation_is_said_to_need_stays_small_for_the_documented_populations():
    from fedpar.datasets.memory import GIB
    from fedpar.datasets.synthetic import SyntheticSpec, memory_needed

    assert memory_needed(SyntheticSpec(clients=1_000_000), processes=3) < 0.2 * GIB  # docs: a million clients
    assert memory_needed(SyntheticSpec(clients=10_000_000), processes=1) < 0.5 * GIB  # a 10^7 coordinator
    assert memory_needed(SyntheticSpec(clients=30, samples=20), processes=3) < 0.01 * GIB


@pytest.mark.parametrize("extra, line", [
    (["--num-partitions", "100000"], "fedpar client: --num-partitions 100000: cannot give 100000 clients at least one "
                                     "example each from 1437 examples; give a smaller --num-partitions"),
    (["--num-partitions", "500", "--partition", "dirichlet:0.5"],
     "fedpar client: --num-partitions 500 (--partition dirichlet:0.5): at least 10 examples per client is impossible "
     "with 500 clients and 1437 examples; give a lower minimum (dirichlet:0.5:MIN, e.g. dirichlet:0.5:1) or give a "
     "smaller --num-partitions"),
    (["--num-partitions", "5", "--dataset", "synthetic:1:1:10"],
     "fedpar client: --num-partitions 5: the data has 10 clients of its own; run it with --num-partitions 10"),
    (["--num-partitions", "3", "--partition-index", "3"],
     "fedpar client: --partition-index 3 is not below --num-partitions 3; give an index from 0 to 2"),
])
def test_a_num_partitions_the_data_cannot_give_names_the_flag_not_the_task(tmp_path, capfd, extra, line):
    """It said: the task's client_data raised ValueError: ... for partition 0 of 100000: fix the task (mlp on
    digits)."""
    done = run_main([*CLIENT, *extra], capfd, tmp_path)
    assert done.returncode == 2, done.stderr
    said = _one_line(done.stderr, "fedpar client:")
    assert said == line and "task" not in said


def test_a_missing_or_unreadable_run_config_file_is_one_line_naming_it(tmp_path, capfd):
    pytest.importorskip("flwr")
    (tmp_path / "folder.toml").mkdir()
    (tmp_path / "bad.toml").write_text('num-server-rounds = "x\n')
    fix = "(a --run-config ending in .toml is a file of overrides; else give KEY=VALUE pairs)"
    cases = [("missing.toml", f"--run-config missing.toml does not exist {fix}"),
             ("folder.toml", f"--run-config folder.toml is a folder; give a TOML file {fix}"),
             ("bad.toml", "--run-config bad.toml is not valid TOML: ")]
    for given, line in cases:
        done = run_main([*CLIENT, "--flower-app", str(ROOT / "examples" / "flower_app"), "--run-config", given],
                        capfd, tmp_path)
        assert done.returncode == 2, done.stderr
        said = _one_line(done.stderr, "fedpar client:")
        assert said.startswith(f"fedpar client: {line}") and "Errno" not in said, said


@pytest.mark.parametrize("argv, line", [
    (["simulate", "--strategy", "fedprox", "--strategy-option", "mu=0.1", "--strategy-option", "mu=0.5"],
     "fedpar simulate: error: --strategy-option mu is given twice, as mu=0.1 and as mu=0.5; give it once, with the "
     "value you mean"),
    (["serve", "--strategy", "fedadam", "--strategy-option", "eta=0.1", "--strategy-option", "eta = 0.2"],
     "fedpar serve: error: --strategy-option eta is given twice, as eta=0.1 and as eta=0.2"),
    (["train", "--task", "examples/own_task.py:task", "--task-option", "csv=a.csv", "--task-option", "csv=b.csv"],
     "fedpar train: error: --task-option csv is given twice, as csv=a.csv and as csv=b.csv"),
])
def test_a_key_value_option_given_twice_is_refused_naming_both_values(tmp_path, capfd, argv, line):
    done = run_main([*argv, "--out", str(tmp_path / "run")], capfd, ROOT)
    assert done.returncode == 2, done.stderr
    _one_line(done.stderr, line)
    assert not (tmp_path / "run").exists()


def test_a_key_value_option_table_given_as_a_list_with_a_key_twice_is_refused(tmp_path, capfd):
    config = tmp_path / "c.toml"
    config.write_text('[simulate]\nstrategy = "fedprox"\nstrategy_options = ["mu=0.1", "mu=0.5"]\n')
    done = run_main(["simulate", "--config", str(config), "--out", str(tmp_path / "run")], capfd, tmp_path)
    assert done.returncode == 2, done.stderr
    _one_line(done.stderr, "fedpar simulate: --strategy-option: mu is given twice, as mu=0.1 and as mu=0.5")


def test_a_key_value_option_may_repeat_its_value_and_override_the_config_files(tmp_path):
    from fedpar.cli.config import apply_config_defaults
    from fedpar.cli.main import build_parser, subcommand_parser

    config = tmp_path / "c.toml"
    config.write_text('[simulate.strategy_options]\nmu = 0.3\n')
    argv = ["--config", str(config), "--strategy-option", "mu=0.1", "--strategy-option", "mu=0.1"]
    parser = build_parser(only="simulate")
    apply_config_defaults(subcommand_parser(parser, "simulate"), argv, "simulate")
    assert parser.parse_args(["simulate", *argv]).strategy_options == {"mu": "0.1"}
    assert parser.parse_args(["simulate", "--strategy-option", "mu=0.2"]).strategy_options == {"mu": "0.2"}


def test_top_level_keys_beside_the_commands_table_are_refused_in_one_line(tmp_path, capfd):
    """rounds = 1 above [simulate] was ignored: simulate ran its default rounds, saying nothing."""
    cases = [('rounds = 1\nseed = 3\n[simulate]\nclients = 2\n[serve]\nrounds = 2\n',
              "rounds, seed at the top level would be ignored: with a [simulate] table 'fedpar simulate' reads only "
              "that table; move them into [simulate] (or into the table of the command they are for)"),
             ('[parallel]\ntp = 1\n[simulate]\nclients = 2\n',
              "[parallel] at the top level would be ignored: with a [simulate] table 'fedpar simulate' reads only "
              "that table; move it into [simulate] (or into the table of the command it is for)"),
             # the command's table beside other commands' tables only: read, and its own mistake is what is said
             ('[simulate]\nrounds = "ten"\n[serve]\nrounds = 2\n[client]\nagent_id = "a"\n',
              "rounds: expected an integer, got 'ten'")]
    for text, line in cases:
        config = tmp_path / "c.toml"
        config.write_text(text)
        done = run_main(["simulate", "--config", str(config), "--out", str(tmp_path / "run")], capfd, tmp_path)
        assert done.returncode == 2, done.stderr
        assert _one_line(done.stderr, line) == f"fedpar simulate: {config}: {line}"
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command, text, table, meant", [
    ("simulate", "[simulat]\nrounds = 1\n", "simulat", "simulate"),  # read as simulate's, by chance
    ("simulate", "[serv]\nrounds = 1\n", "serv", "serve"),  # serve's rounds, taken by simulate
    ("run", '[runs]\ncontrol = "127.0.0.1:1"\n', "runs", "run"),
])
def test_a_table_named_like_a_command_but_not_one_is_refused_in_one_line(command, text, table, meant, tmp_path,
                                                                          capfd):
    """QA: a top-level table read as a group of the command's options, whatever its name: a [serv] table's keys
    set 'fedpar simulate''s options, saying nothing."""
    config = tmp_path / "c.toml"
    config.write_text(text)
    argv = [command, "ls"] if command == "run" else [command, "--out", str(tmp_path / "run")]
    done = run_main([*argv, "--config", str(config)], capfd, tmp_path)
    assert (done.returncode, done.stderr) == (2, f"fedpar {command}: {config}: [{table}] is no command's table (did "
                                                 f"you mean [{meant}]?); rename it\n"), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


def test_top_level_keys_of_a_file_without_the_commands_table_still_apply(tmp_path):
    from fedpar.cli.config import apply_config_defaults
    from fedpar.cli.main import build_parser, subcommand_parser

    config = tmp_path / "c.toml"
    config.write_text('rounds = 3\n[serve]\nrounds = 2\n')
    parser = build_parser(only="simulate")
    argv = ["--config", str(config)]
    assert apply_config_defaults(subcommand_parser(parser, "simulate"), argv, "simulate") == {"rounds"}
    assert parser.parse_args(["simulate", *argv]).rounds == 3


@pytest.mark.parametrize("scheme", ["http", "https", "grpc"])
def test_a_server_given_as_a_url_is_refused_and_its_host_port_reaches_the_coordinator(tmp_path, scheme, capfd):
    """'--server http://127.0.0.1:PORT' was taken as a gRPC target whose host never resolves: the agent retried for
    ever, 'coordinator unreachable (UNAVAILABLE)', beside a coordinator that was listening (QA, first deployment)."""
    port_file = tmp_path / "port"
    serve = subprocess.Popen([sys.executable, "-m", "fedpar", "serve", "--insecure", "--port", "0", "--port-file",
                              str(port_file), "--min-available", "1", "--rounds", "1", "--out", str(tmp_path / "run")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if port_file.exists() and port_file.read_text().strip():
                break
            time.sleep(0.05)
        target = f"127.0.0.1:{port_file.read_text().strip()}"
        agent = ["client", "--insecure", "--agent-id", "a", "--give-up-after", "20"]  # its main in this process
        done = run_main([*agent, "--server", f"{scheme}://{target}/"], capfd)
        line = _one_line(done.stderr, "a gRPC address has no")
        assert done.returncode == 2 and line == (f"fedpar client: error: argument --server: '{scheme}://{target}/': a "
                                                 f"gRPC address has no {scheme}://; give HOST:PORT, e.g. {target} (TLS "
                                                 "is set by --certs); see 'fedpar client --help'"), done.stderr
        done = run_main([*agent, "--server", target], capfd)
        assert done.returncode == 0 and "1 update accepted" in done.stdout, done.stderr[-3000:]
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()


@pytest.mark.parametrize("given, said", [
    (["--compression", "topk"], "(--compression: fedpar serve's, not an agent's: the coordinator decides the rounds, "
                                "the training settings and the outputs, and sends each agent what it needs with its "
                                "tasks; leave it out here)"),
    (["--lr", "0.1", "--rounds", "2"], "(--lr, --rounds: fedpar serve's, not an agent's:"),
    (["--port", "50051"], "(did you mean --server?)"),
    (["--serverr", "127.0.0.1:1"], "(did you mean --server?)"),
])
def test_a_coordinators_flag_given_to_an_agent_is_said_as_the_coordinators(given, said, capfd):
    """`fedpar client --compression topk` said 'did you mean --precision?' (QA, the compression guide: the
    coordinator puts the method in every task), and --port or --lr nothing at all."""
    done = run_main([*CLIENT, *given], capfd)  # argparse's refusal, in this process
    line = _one_line(done.stderr, "unrecognized arguments")
    assert done.returncode == 2 and said in line and "--precision" not in line, line
