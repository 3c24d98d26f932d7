"""--strategy-option KEY=VALUE (and a TOML table) set a strategy's constructor options, typed and checked."""

from __future__ import annotations

import pytest

from fedpar.aggregation import DPStrategy, build_strategy
from fedpar.cli.config import apply_config_defaults
from fedpar.cli.privacy import privacy_strategy
from fedpar.cli.main import build_parser, main
from fedpar.cli.strategy_options import strategy_options_from_args


def _parse(argv):
    parser = build_parser()
    apply_config_defaults(parser._subparsers._group_actions[0].choices[argv[0]], argv[1:], argv[0])
    return parser.parse_args(argv)


def _build(argv):
    args = _parse(argv)
    return build_strategy(args.strategy, **strategy_options_from_args(args))


@pytest.mark.parametrize("command", ["serve", "simulate"])
def test_every_strategy_takes_its_options_from_the_command_line(command):
    s = _build([command, "--strategy", "fedprox", "--strategy-option", "mu=0.05"])
    assert s.proximal_mu == 0.05 and s.client_config(1) == {"proximal_mu": 0.05}
    s = _build([command, "--strategy", "fedavgm", "--strategy-option", "server_momentum=0.5",
                "--strategy-option", "lr=0.7"])
    assert (s.server_momentum, s.server_learning_rate) == (0.5, 0.7)
    for name in ("fedadam", "fedyogi", "fedadagrad"):
        s = _build([command, "--strategy", name, "--strategy-option", "eta=0.03", "--strategy-option", "beta-1=0.8",
                    "--strategy-option", "beta2=0.95", "--strategy-option", "tau=1e-4",
                    "--strategy-option", "bias_correction=true"])
        assert (s.name, s.eta, s.beta_1, s.beta_2, s.tau, s.bias_correction) == (name, 0.03, 0.8, 0.95, 1e-4, True)
    assert _build([command, "--strategy", "trimmed-mean", "--strategy-option", "fraction=0.3"]).beta == 0.3
    s = _build([command, "--strategy", "krum", "--strategy-option", "f=2"])
    assert (s.num_malicious, s.num_selected) == (2, 1)
    s = _build([command, "--strategy", "multikrum", "--strategy-option", "num_malicious=1", "--strategy-option", "m=3"])
    assert (s.num_malicious, s.num_selected) == (1, 3) and isinstance(s.num_selected, int)
    assert _parse([command]).strategy_options == {}  # no flag: the constructor's defaults
    assert _build([command, "--strategy", "fedprox"]).proximal_mu == 0.01


def test_dp_wraps_the_configured_strategy():
    # (a key given twice with two values is refused: tests/cli/test_input_refusals.py)
    args = _parse(["simulate", "--strategy", "fedprox", "--strategy-option", "mu=0.2", "--privacy", "central"])
    name, dp = privacy_strategy(args, args.strategy, 10, 1.0, 100)
    s = build_strategy(name, **strategy_options_from_args(args), **dp)
    assert isinstance(s, DPStrategy) and s.inner.proximal_mu == 0.2


def test_a_privacy_delta_at_or_above_one_over_the_population_is_refused_and_the_default_there_warned(caplog,
                                                                                                      capsys):
    """(epsilon, delta)-DP with delta >= 1/n allows releasing one client's data outright: a --privacy-delta the user
    gave there is refused (QA: 0.5 over 10 clients was taken, epsilon 0.98 reported); the default over a population
    of 10^6 is warned about once."""
    import logging

    assert main(["simulate", "--clients", "10", "--rounds", "1", "--privacy", "central", "--privacy-delta", "0.5",
                 "--quiet"]) == 2
    assert capsys.readouterr().err == ("fedpar simulate: --privacy-delta 0.5 is not below 1 / population (1/10 = 0.1): "
                                       "at such a delta the reported epsilon guarantees nothing; pick one below 0.1\n")
    below = _parse(["simulate", "--privacy", "central", "--privacy-delta", "0.09"])
    assert privacy_strategy(below, below.strategy, 5, 1.0, 10)[1]["delta"] == 0.09
    default = _parse(["simulate", "--privacy", "central"])
    caplog.set_level(logging.WARNING, logger="fedpar.privacy")
    assert privacy_strategy(default, default.strategy, 100, 1.0, 10**6)[1]["delta"] == 1e-5
    assert [r.getMessage() for r in caplog.records] == [
        "the default --privacy-delta 1e-05 is not below 1 / population (1/1000000 = 1e-06): at such a delta the "
        "reported epsilon guarantees nothing; give --privacy-delta below 1e-06"]


@pytest.mark.parametrize("option, message", [
    ("mux=1", "unknown option 'mux' for strategy 'fedprox'; valid options: proximal_mu (alias mu; float, "
              "default 0.01)"),
    ("mu=abc", "option 'mu' (FedProx's proximal_mu) of strategy 'fedprox' must be a number, got 'abc'"),
    ("proximal_mu=abc", "option 'proximal_mu' of strategy 'fedprox' must be a number, got 'abc'"),
    ("mu=nan", "must be finite"),
    ("mu=-1", "mu (proximal_mu) must be >= 0"),
    ("fold_config=x", "unknown option 'fold_config'"),  # not settable from text
])
def test_a_bad_option_is_a_clear_error_before_anything_starts(option, message, capsys):
    assert main(["simulate", "--strategy", "fedprox", "--strategy-option", option, "--rounds", "1"]) == 2
    assert message in capsys.readouterr().err


def test_a_flower_strategys_bad_option_is_named_as_typed(capsys):
    """It said 'option 'server_momentum' ...', a name the user never typed (QA)."""
    pytest.importorskip("flwr")
    assert main(["simulate", "--strategy", "flower:flwr.server.strategy:FedAvgM", "--strategy-option", "momentum=abc",
                 "--rounds", "1"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["fedpar simulate: option 'momentum' (FedAvgM's server_momentum) of strategy "
                     "'flower:flwr.server.strategy:FedAvgM' must be a number, got 'abc'"]


def test_serve_refuses_a_bad_option_name_listing_the_valid_ones(capsys, tmp_path):
    argv = ["serve", "--insecure", "--port", "0", "--out", str(tmp_path), "--strategy", "krum",
            "--strategy-option", "byzantine=2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown option 'byzantine' for strategy 'krum'" in err
    assert "num_malicious (alias f; int, default 0); num_selected (alias m; int, default 1)" in err
    assert main(["serve", "--insecure", "--port", "0", "--strategy", "fedavg", "--strategy-option", "mu=1"]) == 2
    assert "strategy 'fedavg'; it takes no options" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error: not KEY=VALUE
        main(["serve", "--insecure", "--strategy-option", "mu"])
    assert "--strategy-option expects KEY=VALUE, got 'mu'" in capsys.readouterr().err


def test_a_negative_multikrum_selection_is_refused_not_krum():
    """num_selected=-3 ran Krum (one update selected) in silence (QA)."""
    with pytest.raises(ValueError, match=r"num_selected must be >= 0 \(0: n - f\), got -3"):
        _build(["simulate", "--strategy", "multikrum", "--strategy-option", "m=-3"])


def test_krum_counts_must_be_integers():
    with pytest.raises(ValueError, match=r"option 'f' \(Krum's num_malicious\) of strategy 'krum' must be an "
                                         r"integer, got '1.5'"):
        _build(["serve", "--strategy", "krum", "--strategy-option", "f=1.5"])
    with pytest.raises(ValueError, match="must be true or false"):
        _build(["serve", "--strategy", "fedadam", "--strategy-option", "bias_correction=maybe"])


def test_config_file_table_or_list_sets_the_options_and_flags_override(tmp_path):
    toml = tmp_path / "fl.toml"
    toml.write_text('[serve]\nstrategy = "fedadam"\n[serve.strategy_options]\neta = 0.02\ntau = 0.001\n'
                    'bias_correction = true\n'
                    '[simulate]\nstrategy = "multikrum"\nstrategy_options = ["f=1", "m=2"]\n')
    s = _build(["serve", "--config", str(toml)])
    assert (s.name, s.eta, s.tau, s.bias_correction) == ("fedadam", 0.02, 0.001, True)
    s = _build(["serve", "--config", str(toml), "--strategy-option", "eta=0.5"])
    assert (s.eta, s.tau) == (0.5, 0.001)  # the flag wins for its key; the file's other keys stay
    s = _build(["simulate", "--config", str(toml)])
    assert (s.name, s.num_malicious, s.num_selected) == ("multikrum", 1, 2)
    toml.write_text('[serve]\nstrategy = "fedavgm"\n[serve.strategy_options]\nmomentum = 0.5\nserver_momentum = 0.6\n')
    with pytest.raises(ValueError, match="'server_momentum' of strategy 'fedavgm' is given twice"):
        _build(["serve", "--config", str(toml)])
    toml.write_text('[serve]\nstrategy = "trimmed_mean"\n[serve.strategy_options]\ntrim = 0.1\n')
    with pytest.raises(ValueError, match=r"valid options: beta \(alias fraction; float, default 0.2\)"):
        _build(["serve", "--config", str(toml)])


def test_help_lists_every_strategys_options():
    for command in ("serve", "simulate"):
        text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        flat = " ".join(text.split())
        assert "--strategy-option KEY=VALUE" in flat and f"[{command}.strategy_options]" in flat
        for piece in ("fedprox: proximal_mu (mu)", "fedavgm: server_learning_rate (lr), server_momentum (momentum)",
                      "fedadam/fedyogi/fedadagrad: eta (lr), beta_1 (beta1), beta_2 (beta2), tau, bias_correction",
                      "trimmed_mean: beta (fraction)", "krum/multikrum: num_malicious (f), num_selected (m)"):
            assert piece in flat
