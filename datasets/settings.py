"""The data settings, declared once for every command that reads a dataset (``fedpar.settings``): which dataset
and model, where its files are, and how a federation splits it. Light: the command line reads it without torch."""

from __future__ import annotations

from dataclasses import dataclass

from fedpar.datasets.partition import PARTITION_HELP
from fedpar.datasets.registry import DATASET_HELP
from fedpar.settings import DEFINES, UNRECORDED, setting


@dataclass
class DataSource:
    """Which dataset (a name of the dataset registry) and which model of the zoo."""

    dataset: str = setting("digits", group="data", help=DATASET_HELP, resume=DEFINES)
    model: str = setting("mlp", group="data",
                         help="model of the zoo: mlp, or cnn (the FedAvg paper's CNN); train also takes gpt (on "
                              "--dataset text, where it is the default) and serve synthetic (no data: see --params). "
                              "A federation's coordinator and agents use the same", resume=DEFINES)


@dataclass
class DataFiles:
    """Where a dataset's files are, for the datasets that are not bundled."""

    data_dir: str | None = setting(None, group="data", metavar="DIR",
                                   help="folder with the MNIST files (train.npz and test.npz, or the four IDX "
                                        "files), for --dataset mnist", resume=UNRECORDED)


@dataclass
class Partitioning:
    """How a federation's training set is split over its clients, and the share each keeps for evaluation."""

    partition: str = setting("auto", group="data", help="how the training set is split over the clients, "
                                                        + PARTITION_HELP, resume=DEFINES)
    val_fraction: float = setting(0.1, check="held_out", group="data",
                                  help="share of each client's data kept for federated evaluation, rounded to "
                                       "whole examples; every client keeps one example at least to train on",
                                  resume=DEFINES)
