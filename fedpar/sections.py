"""The settings sections every kind of command shares, declared once (``fedpar.settings``): the seed, the
output folder and its plots. Like ``fedpar.settings`` it depends on nothing: every room may compose them."""

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


@dataclass
class Plots:
    """Whether a run draws its PNG plots into its output folder."""

    plot: bool = setting(True, group="outputs",
                         help="draw the run's PNG plots into --out (simulate and serve: accuracy.png and loss.png, "
                              "simulate also labels.png; train: loss_curve.png); --no-plot skips them and matplotlib's "
                              "import, about a second of CPU a run", resume=UNRECORDED)
