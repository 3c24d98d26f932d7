"""The --privacy options of `fedpar serve` / `fedpar simulate` turn into a DP-FedAvg strategy, or a clear error."""

from __future__ import annotations

import pytest

from fedpar.aggregation import DPStrategy, build_strategy
from fedpar.cli.privacy import privacy_strategy
from fedpar.cli.main import build_parser


def _args(argv):
    return build_parser().parse_args(argv)


def test_simulate_flags_build_an_adaptive_client_side_privacy_strategy():
    args = _args(["simulate", "--strategy", "fedavgm", "--privacy", "client", "--privacy-noise", "0.7",
                  "--privacy-clip", "0.5",
                  "--privacy-adaptive-quantile", "0.4", "--privacy-count-noise", "1.0", "--privacy-delta", "1e-6"])
    name, options = privacy_strategy(args, args.strategy, clients_per_round=10, overselect=1.3, population=100)
    assert name == "dp-fedavgm"
    assert options["sampled_per_round"] == 13 and options["population"] == 100 and options["mode"] == "client"
    s = build_strategy(name, **options)
    assert isinstance(s, DPStrategy) and s.sample_rate == pytest.approx(0.13) and s.adaptive is not None
    assert s.accountant.delta == 1e-6 and s.client_config(1)["dp_clip_norm"] == 0.5


def test_dp_off_changes_nothing_and_serve_needs_the_population():
    args = _args(["serve"])
    assert privacy_strategy(args, "fedavg", 10, 1.3, None) == ("fedavg", {})
    args = _args(["serve", "--privacy", "central"])
    with pytest.raises(ValueError, match="--privacy-population"):
        privacy_strategy(args, "fedavg", 10, 1.3, args.privacy_population)


@pytest.mark.parametrize("command", ["simulate", "serve"])
def test_a_privacy_setting_without_privacy_is_one_line_and_no_run(command, capsys):
    """A user who sets a noise level believes the run is private: without --privacy it would not be."""
    from fedpar.cli.main import main

    extra = ["--insecure", "--port", "0"] if command == "serve" else ["--quiet"]
    assert main([command, "--privacy-noise", "0.3", "--rounds", "1", *extra]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"fedpar {command}: --privacy-noise applies only with --privacy central or --privacy client; "
                     "add one of them (or drop the option)"]


def test_serve_refuses_a_privacy_population_without_privacy(capsys):
    """It was accepted and the run was not private, without a word."""
    from fedpar.cli.main import main

    assert main(["serve", "--privacy-population", "10", "--rounds", "1", "--insecure", "--port", "0"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["fedpar serve: --privacy-population applies only with --privacy central or --privacy client; "
                     "add one of them (or drop the option)"]


def test_local_noise_with_central_privacy_names_the_flags(capsys):
    """It said "use it with mode 'client'", a word of the Python API, not a flag."""
    from fedpar.cli.main import main

    assert main(["simulate", "--privacy", "central", "--privacy-local-noise", "0.1", "--rounds", "1", "--quiet"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["fedpar simulate: --privacy-local-noise applies only with --privacy client, not central: the "
                     "agents add it to their own update; use --privacy client (or drop the option)"]


def test_a_dp_strategy_named_on_the_command_line_says_which_flags_build_it(capsys):
    """It quoted Python's TypeError, naming the wrapper's parameters (one rewritten as the flag --clients-per-round)."""
    from fedpar.cli.main import main

    assert main(["serve", "--strategy", "dp-fedavg", "--rounds", "1", "--insecure", "--port", "0"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["fedpar serve: strategy 'dp-fedavg' is the DP wrapper, built with 4 DP option(s) it was not "
                     "given; give --strategy fedavg with --privacy central (or client) and its --privacy-* settings, "
                     "which set them"]


def test_a_dp_flower_strategy_named_on_the_command_line_is_told_back_in_its_own_case(capsys):
    """QA: it said "give --strategy flower:fedadam", which names no Flower strategy (a reference is
    case-sensitive)."""
    pytest.importorskip("flwr")
    from fedpar.cli.main import main

    assert main(["simulate", "--strategy", "dp-flower:FedAdam", "--secure-aggregation", "--privacy", "client",
                 "--rounds", "1", "--quiet"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["fedpar simulate: strategy 'dp-flower:FedAdam' is the DP wrapper, built with 4 DP option(s) it "
                     "was not given; give --strategy flower:FedAdam with --privacy central (or client) and its "
                     "--privacy-* settings, which set them"]


def test_secagg_max_weight_under_dp_is_one_line_and_no_run(capsys):
    """DP-FedAvg weighs each update 1, which a secure round under DP holds every agent to: a weight cap is refused
    rather than ignored."""
    from fedpar.cli.main import main

    assert main(["serve", "--secure-aggregation", "--privacy", "client", "--privacy-population", "10",
                 "--secagg-max-weight", "100", "--rounds", "1", "--insecure", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--secagg-max-weight does not apply with --privacy" in err, err
