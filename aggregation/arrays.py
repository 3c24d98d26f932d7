"""An update's arrays: their shapes and dtypes (checked against the model's), accumulation dtypes, finiteness."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShapesAndDtypes:
    """The shape and dtype of each array of an unnamed list (a model's weights as strategies see them).

    The wire's view of the same model, with names and byte offsets, is protocol/codec.ModelLayout.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    @classmethod
    def of(cls, arrays: Sequence[np.ndarray]) -> ShapesAndDtypes:
        """Describe ``arrays``; rejects non-numeric dtypes."""
        arrays = [np.asarray(a) for a in arrays]
        if not arrays:
            raise ValueError("an update must contain at least one array; got an empty list")
        for i, a in enumerate(arrays):
            if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
                raise ValueError(f"array {i} has dtype {a.dtype}; only float and integer arrays can be averaged")
        return cls(tuple(a.shape for a in arrays), tuple(a.dtype for a in arrays))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of elements of each array."""
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @property
    def num_elements(self) -> int:
        """Total number of elements over all arrays."""
        return sum(self.sizes)

    def check(self, arrays: Sequence[np.ndarray], who: str = "update") -> list[np.ndarray]:
        """Return ``arrays`` as numpy arrays after checking count, shapes and dtypes against the layout."""
        if len(arrays) != len(self.shapes):
            raise ValueError(f"{who} has {len(arrays)} arrays but the model has {len(self.shapes)}; "
                             "send every parameter array of the model, in the model's order")
        out = []
        for i, (a, shape, dtype) in enumerate(zip(arrays, self.shapes, self.dtypes)):
            a = np.asarray(a)
            if a.shape != shape:
                raise ValueError(f"{who}: array {i} has shape {a.shape}, expected {shape}")
            if a.dtype != dtype:
                raise ValueError(f"{who}: array {i} has dtype {a.dtype}, expected {dtype}")
            out.append(a)
        return out


def accumulate_dtype_for(dtype: np.dtype, accumulate: str) -> np.dtype:
    """The dtype used to accumulate arrays of ``dtype`` under the ``accumulate`` policy."""
    if accumulate not in ("float32", "float64"):
        raise ValueError(f"accumulate_dtype must be 'float32' or 'float64', got {accumulate!r}")
    if np.issubdtype(dtype, np.integer) or dtype == np.float64 or accumulate == "float64":
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def cast_like(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Cast accumulated values back to an input dtype (integers are rounded to nearest)."""
    if values.dtype == dtype:
        return values
    if np.issubdtype(dtype, np.integer):
        return np.rint(values).astype(dtype)
    return values.astype(dtype)


def _blas_asum(dtype: np.dtype):
    """scipy's BLAS asum for float32/float64 (None for other dtypes)."""
    from scipy.linalg import blas

    return {"float32": blas.sasum, "float64": blas.dasum}.get(np.dtype(dtype).name)


def checked_by_blas(a: np.ndarray) -> bool:
    """Whether :func:`all_finite` scans ``a`` with BLAS asum (itself multithreaded by OpenBLAS)."""
    return a.size > 0 and a.flags.c_contiguous and _blas_asum(a.dtype) is not None


def all_finite(a: np.ndarray) -> bool:
    """True if every element of ``a`` is finite (a fast sum test, confirmed exactly when it fails)."""
    if not np.issubdtype(a.dtype, np.floating) or a.size == 0:
        return True
    # A sum runs at memory speed and NaN/Inf anywhere makes it non-finite; BLAS asum (sum of |x|, multithreaded
    # by OpenBLAS, about 1.4x numpy's 2-thread sum here) for contiguous float32/float64, else numpy's sum in the
    # array's own precision (float32 for float16). An overflowing sum of large finite values is a false alarm,
    # settled by the exact test.
    asum = _blas_asum(a.dtype) if a.flags.c_contiguous else None
    with np.errstate(over="ignore", invalid="ignore"):
        total = asum(a.reshape(-1)) if asum is not None else a.sum(dtype=np.float32 if a.dtype == np.float16 else None)
    if np.isfinite(total):
        return True
    return bool(np.isfinite(a).all())
