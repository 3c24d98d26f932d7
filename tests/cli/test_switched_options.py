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


def test_a_config_file_key_without_its_switch_is_refused(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("[simulate]\nsecagg_clip = 1.0\n")
    assert main(["simulate", "--config", str(config), "--rounds", "1", "--quiet"]) == 2
    assert _lines(capsys) == ["fedpar simulate: --secagg-clip applies only with --secure-aggregation; add it (or "
                              "drop the option)"]


def test_with_its_switch_the_option_is_taken(capsys):
    """Refused for another reason (one client cannot hide in a sum), not for the clip."""
    assert main(["simulate", "--secure-aggregation", "--secagg-clip", "0.5", "--clients", "1", "--quiet"]) == 2
    lines = _lines(capsys)
    assert len(lines) == 1 and "applies only with" not in lines[0] and "secure aggregation" in lines[0]
