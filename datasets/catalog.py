"""The datasets there are: each dataset module of fedpar.datasets declares its entries by decorating its loader with
``@register_dataset(NAME, help=...)``, and :func:`dataset_entries` finds them. The command line reads their names and
help without torch, so a dataset module imports torch only inside its functions."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from fedpar.discovery import import_declaring

PACKAGE = "fedpar.datasets"
_REGISTERED: dict[str, Dataset] = {}
_FOUND: list[Dataset] = []


@dataclass(frozen=True)
class Dataset:
    """One entry of the dataset registry: its name, how ``--dataset`` writes it, what it is, and how it loads."""

    name: str  # the word before any ':' ("digits", "synthetic", "npz")
    usage: str  # how --dataset writes it, in its help: "npz:PATH", "synthetic[:ALPHA:BETA...]" (a bare name too)
    help: str
    load: Callable[..., Any]  # load(name, [data_dir,] **its options) -> DatasetSplits; name as the user wrote it
    folder: str = ""  # what its data folder must hold, when it needs one (--data-dir; train's --data-path)
    train: Callable[..., Any] | None = None  # train(name, data_path, block_size, seed): a set train reads otherwise
    full_name: Callable[[str, int], str] | None = None  # full_name(name, clients): what a federation fills in
    # fits(full name, processes, partition): ValueError when this machine's memory cannot hold the federation
    fits: Callable[[str, int, str], None] | None = None
    model: str = "mlp"  # the zoo's model it trains when --model is not given

    def matches(self, key: str) -> bool:
        """Whether lower-cased ``key`` names this dataset (``NAME``, or ``NAME:...`` when its usage takes more)."""
        takes_more = self.usage != self.name
        bare = not takes_more or self.usage.startswith(self.name + "[")
        return (bare and key == self.name) or (takes_more and key.startswith(self.name + ":"))

    def takes(self, option: str) -> bool:
        """Whether its loader takes keyword ``option``."""
        return option in inspect.signature(self.load).parameters


def register_dataset(name: str, *, help: str, usage: str = "", folder: str = "",
                     train: Callable[..., Any] | None = None,
                     full_name: Callable[[str, int], str] | None = None,
                     fits: Callable[[str, int, str], None] | None = None,
                     model: str = "mlp") -> Callable[[Callable], Callable]:
    """Decorator of a loader: offer it as dataset ``name`` (``--dataset``, ``load_dataset``; the rest as
    :class:`Dataset` says)."""

    def register(load: Callable) -> Callable:
        known = _REGISTERED.get(name)
        if known is not None and known.load.__qualname__ != load.__qualname__:
            raise TypeError(f"dataset name {name!r} is taken by {known.load.__module__}.{known.load.__qualname__}")
        _REGISTERED[name] = Dataset(name, usage or name, help, load, folder, train, full_name, fits, model)
        return load

    return register


def dataset_entries() -> list[Dataset]:
    """Every registered dataset of fedpar.datasets, by module and, within a module, in the order it declares them."""
    if not _FOUND:
        import_declaring(PACKAGE, register_dataset.__name__)
        ours = [d for d in _REGISTERED.values() if d.load.__module__.startswith(PACKAGE + ".")]
        _FOUND.extend(sorted(ours, key=lambda d: d.load.__module__))  # a stable sort: declaration order kept
    return list(_FOUND)
