"""build_strategy takes the short option aliases the command line takes (``fedpar simulate --help``:
``server_learning_rate (lr)``), resolved by the same code (aggregation/options.py's typed_options)."""

import pytest

from fedpar.aggregation import build_strategy, parse_strategy_options
from fedpar.aggregation.catalog import strategy_classes
from fedpar.aggregation.options import option_specs

ALIASED = [(key, spec.name, alias, {int: 1, float: 0.05}[spec.type])
           for key, cls in strategy_classes().items() for spec in option_specs(cls).values() for alias in spec.aliases]


def test_there_are_aliases_to_check():
    assert ("fedavgm", "server_learning_rate", "lr", 0.05) in ALIASED


@pytest.mark.parametrize("key, name, alias, value", ALIASED, ids=lambda v: str(v))
def test_build_strategy_takes_the_clis_aliases(key, name, alias, value):
    assert parse_strategy_options(key, {alias: str(value)}) == {name: value}  # what the command line makes of it
    strategy = build_strategy(key, **{alias: value})
    assert getattr(strategy, name) == value


def test_fedavgm_lr_as_the_qa_report_gave_it():
    s = build_strategy("fedavgm", lr=0.5, momentum=0.0)
    assert (s.server_learning_rate, s.server_momentum) == (0.5, 0.0)
    assert build_strategy("dp-fedprox", mu=0.25, noise_multiplier=0.8, clip_norm=2.0, population=20,
                          clients_per_round=5).inner.proximal_mu == 0.25


def test_an_alias_and_its_name_together_are_refused():
    with pytest.raises(ValueError, match="given twice"):
        build_strategy("fedavgm", lr=0.5, server_learning_rate=1.0)


def test_an_unknown_option_still_names_the_valid_ones_with_their_aliases():
    with pytest.raises(ValueError, match=r"unknown option 'nu'.*proximal_mu \(alias mu"):
        build_strategy("fedprox", nu=1)
