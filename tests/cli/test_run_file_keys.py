"""A run file's unknown key is named with what to write instead: the run setting it likely misspells, or, for a
setting of the service's own (its folders, ports), the serve flag that sets it when the service starts."""

from __future__ import annotations

import pytest

from fedpar.cli.config import ConfigError
from fedpar.cli.run_settings import read_run_file


@pytest.mark.parametrize("line, said", [
    ("client_per_round = 2", "client_per_round (did you mean clients_per_round?)"),
    ('strategi = "fedavg"', "strategi (did you mean strategy?)"),
    ('out = "results"', "out (the service's own, set by fedpar serve --out when it starts)"),
    ('data_dir = "mnist"', "data_dir (the service's own, set by fedpar serve --data-dir when it starts)"),
    ("colour = 3", "unknown run setting(s) colour; a run sets only batch_size, "),
])
def test_an_unknown_run_key_is_told_what_to_write_instead(line, said, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f"rounds = 2\n{line}\n")
    with pytest.raises(ConfigError) as refused:
        read_run_file(path)
    message = str(refused.value)
    assert said in message and "\n" not in message, message


def test_a_run_file_of_known_keys_reads_as_typed_settings(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('rounds = 3\nclients_per_round = 2\nlr = 0.05\nstrategy = "fedprox"\n')
    assert read_run_file(path) == {"rounds": 3, "clients_per_round": 2, "learning_rate": 0.05, "strategy": "fedprox"}
