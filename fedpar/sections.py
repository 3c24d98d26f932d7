"""The settings sections every kind of command shares, declared once (``fedpar.settings``): the seed and the
output folder. Like ``fedpar.settings`` it depends on nothing: every room may compose them."""

from __future__ import annotations

from dataclasses import dataclass

from fedpar.settings import DEFINES, UNRECORDED, setting


@dataclass
class Seeded:
    """The seed of a command's randomness."""

    seed: int = setting(0, check="seed", group="data",
                        help="seed of this command's randomness: initial weights, sampling, the data split and "
                             "shuffling, whichever it does (processes that must agree, such as the hosts of one "
                             "population, take the same)", resume=DEFINES)


@dataclass
class Output:
    """The folder a command writes into."""

    out: str | None = setting(None, check="folder", group="outputs", metavar="DIR",
                              help="folder this command writes into, created if missing: a run's metrics, summary, "
                                   "plots and final model (train: also its checkpoints); certs: the CA, "
                                   "certificates, keys and tokens (a CA already there is reused)", resume=UNRECORDED)
