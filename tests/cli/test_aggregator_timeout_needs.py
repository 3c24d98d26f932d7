"""--aggregator-timeout bounds a wait for another aggregator rank: without several ranks it is refused in one line
(exit 2), as every other option whose feature is off (it was ignored in silence, exit 0)."""

from __future__ import annotations

import pytest

from fedpar.cli.main import main

REFUSAL = "--aggregator-timeout applies only with --aggregator-ranks above 1; add it (or drop the option)"


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("command", [["serve", "--insecure", "--port", "0"], ["simulate", "--rounds", "1", "--quiet"]],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("ranks", [[], ["--aggregator-ranks", "1"]], ids=["default-ranks", "one-rank"])
def test_an_aggregator_timeout_without_several_ranks_is_refused(command, ranks, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*command, *ranks, "--aggregator-timeout", "5", "--out", str(tmp_path)]) == 2
    assert _lines(capsys) == [f"fedpar {command[0]}: {REFUSAL}"]


def test_a_config_file_aggregator_timeout_without_several_ranks_is_a_note(tmp_path, monkeypatch, capsys):
    """A file's table is shared by all of a command's uses (cli/config.py ignored_given): the next check here, the
    --out that is a file, is the refusal."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = tmp_path / "run.toml"
    config.write_text("[simulate]\naggregator_timeout_seconds = 5.0\n")
    (tmp_path / "a-file").write_text("")
    assert main(["simulate", "--config", str(config), "--rounds", "1", "--quiet", "--out", str(tmp_path / "a-file")]) \
        == 2
    lines = _lines(capsys)
    assert lines[0] == f"fedpar simulate: note: ignored from {config}: aggregator_timeout_seconds (it needs " \
                       "--aggregator-ranks above 1)"
    assert len(lines) == 2 and "is a file, not a folder" in lines[1], lines


@pytest.mark.parametrize("ranks, world", [(["--aggregator-ranks", "2"], None), ([], "2")],
                         ids=["aggregator-ranks-2", "torchrun-world-2"])
def test_with_several_ranks_the_aggregator_timeout_is_taken(ranks, world, tmp_path, monkeypatch, capsys):
    """Refused for another reason (one agent cannot hide in a sum), not for the timeout; under torchrun every
    launched process is a rank whatever --aggregator-ranks says."""
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert main(["serve", "--insecure", "--port", "0", *ranks, "--aggregator-timeout", "5", "--secure-aggregation",
                 "--clients-per-round", "1", "--out", str(tmp_path), "--device", "cpu"]) == 2
    lines = [line for line in _lines(capsys) if line.startswith("fedpar serve: ")]
    assert len(lines) == 1 and "secure aggregation hides each update" in lines[0], lines
