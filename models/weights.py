"""Moving a model's floating-point state to and from lists of numpy arrays (what the wire format carries)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


def _float_entries(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    entries = [(name, t) for name, t in model.state_dict().items() if torch.is_floating_point(t)]
    for name, t in entries:
        if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
            raise ValueError(f"state entry {name!r} is a {type(t).__name__}, not a plain tensor; for a sharded "
                             "(FSDP/TP) model gather a full state dict first (torch.distributed.checkpoint."
                             "state_dict.get_model_state_dict(..., full_state_dict=True)) and load it into an "
                             "unsharded copy")
    return entries


def _numpy_dtype(name: str, tensor: torch.Tensor) -> np.dtype:
    try:
        return np.dtype(str(tensor.dtype).removeprefix("torch."))
    except TypeError:
        raise ValueError(f"state entry {name!r} has dtype {tensor.dtype}, which numpy cannot hold (weights travel and "
                         "are written as numpy arrays); keep the model's weights float32 (model.float()); simulate "
                         "and client compute in bfloat16 with --precision bf16") from None


def weight_specs(model: nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, numpy dtype name such as 'float32', shape) of each floating-point state_dict entry, in order."""
    return [(name, _numpy_dtype(name, t).name, tuple(t.shape)) for name, t in _float_entries(model)]


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """Copies of the floating-point state_dict entries as contiguous numpy arrays, in state_dict order."""
    return ModelWeights(model).get()


def set_weights(model: nn.Module, arrays: Sequence[np.ndarray]) -> None:
    """Copy ``arrays`` into the model's floating-point state (same order as ``get_weights``).

    Everything is validated before anything is written, so a bad list leaves the model unchanged.
    """
    ModelWeights(model).set(arrays)


class ModelWeights:
    """:func:`get_weights` and :func:`set_weights` for one model whose tensors stay in place (fedpar's own training
    updates them in place): its entries are listed once, not by a state_dict walk of the module tree per call, and
    a CPU tensor's memory is read and written as a numpy array (no torch call per entry)."""

    def __init__(self, model: nn.Module):
        self.entries = _float_entries(model)

    @functools.cached_property
    def _plan(self) -> list[tuple[np.dtype, tuple[int, ...], np.ndarray | None]]:
        """Per entry: its numpy dtype (checked at the first get or set: a clear error if numpy cannot hold it), its
        shape, and on the CPU its tensor's own memory as a numpy array (None on other devices)."""
        return [(_numpy_dtype(name, t), tuple(t.shape), t.detach().numpy() if t.device.type == "cpu" else None)
                for name, t in self.entries]

    def get(self) -> list[np.ndarray]:
        """Copies of the model's floating-point state, as :func:`get_weights`."""
        return [np.ascontiguousarray(t.detach().cpu().numpy()) if view is None else view.copy()  # copy(): C order
                for (_, t), (_, _, view) in zip(self.entries, self._plan)]

    def set(self, arrays: Sequence[np.ndarray]) -> None:
        """Copy ``arrays`` into the model, as :func:`set_weights`."""
        self.check(arrays)
        with torch.no_grad():
            for (_, t), (_, _, view), a in zip(self.entries, self._plan, arrays):
                if view is not None:
                    np.copyto(view, a)  # read-only or strided sources too, with no intermediate copy
                else:
                    # np.require copies read-only (e.g. np.frombuffer) or strided arrays, which torch.from_numpy
                    # rejects.
                    t.copy_(torch.from_numpy(np.require(a, requirements=["C", "W"])))

    def check(self, arrays: Sequence[np.ndarray]) -> None:
        """ValueError, saying which, unless ``arrays`` are numpy arrays of the model's entries' dtypes and shapes."""
        plan = self._plan
        if len(arrays) != len(plan):
            raise ValueError(f"expected {len(plan)} weight arrays for this model but got {len(arrays)}; "
                             "the weights were made for a different model architecture")
        for i, ((name, _), (dtype, shape, _), a) in enumerate(zip(self.entries, plan, arrays)):
            if not isinstance(a, np.ndarray):
                raise ValueError(f"weight {i} ({name!r}) must be a numpy array, got {type(a).__name__}")
            if a.dtype != dtype:
                raise ValueError(f"weight {i} ({name!r}) has dtype {a.dtype}, expected {dtype}")
            if a.shape != shape:
                raise ValueError(f"weight {i} ({name!r}) has shape {a.shape}, expected {shape}")
