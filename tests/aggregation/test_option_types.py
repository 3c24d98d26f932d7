"""A strategy built in Python with an option of the wrong type is refused as it is built, naming the option: the
types --strategy-option is read as, checked once for both paths."""

from __future__ import annotations

import pytest

from fedpar.aggregation import FedAvgM, build_strategy
from fedpar.aggregation.catalog import strategy_classes
from fedpar.aggregation.options import option_specs


def test_an_option_of_the_wrong_type_names_the_option():
    # before: TypeError: '<=' not supported between instances of 'str' and 'int' (fedavg_strategies.py)
    with pytest.raises(TypeError, match=r"^FedAvgM's server_learning_rate must be a number, got '1'$"):
        FedAvgM(server_learning_rate="1")
    with pytest.raises(TypeError, match=r"^FedAvgM's server_momentum must be a number, got True$"):
        FedAvgM(0.5, True)


def test_options_of_their_types_build_from_python_and_from_text():
    assert FedAvgM(server_learning_rate=1, server_momentum=0.5).server_learning_rate == 1.0
    assert build_strategy("fedavgm", lr=0.5).server_learning_rate == 0.5


NUMERIC = [(cls, spec.name) for cls in strategy_classes().values() for spec in option_specs(cls).values()
           if spec.type in (int, float)]


@pytest.mark.parametrize("cls, option", NUMERIC, ids=[f"{cls.name}-{option}" for cls, option in NUMERIC])
def test_every_strategy_refuses_text_for_a_number(cls, option):
    with pytest.raises(TypeError, match=f"^{cls.__name__}'s {option} must be "):
        cls(**{option: "1"})
