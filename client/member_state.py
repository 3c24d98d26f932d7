"""What a virtual client keeps from one round to the next, kept off the heap: its top-k error-feedback residual.

A residual is as large as the model, and only clients that were ever sampled have one, so a host keeps them in a
folder, one ``.npy`` file per client (the residual flattened to float32; read back with ``allow_pickle=False``).
Memory stays one residual per seat whatever the population; the disk holds one model per client sampled so far.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np


class ResidualStore:
    """Per-client residuals in a folder (a fresh temporary one unless ``folder`` is given); :meth:`close` removes a
    temporary one."""

    def __init__(self, shapes: list[tuple[int, ...]], folder: str | Path | None = None):
        self.shapes = [tuple(s) for s in shapes]
        self._own = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="fedpar-residuals-") if folder is None else folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._kept = {path.stem for path in self.folder.glob("*.npy")}  # who has a file: no disk call for the rest

    def _path(self, client: str) -> Path:
        return self.folder / f"{client}.npy"  # client ids are checked names (no path separators)

    def load(self, client: str) -> list[np.ndarray] | None:
        """``client``'s residual, or None when it has none yet."""
        if client not in self._kept:
            return None
        path = self._path(client)
        flat = np.load(path, allow_pickle=False)
        sizes = [int(np.prod(s)) for s in self.shapes]
        if flat.size != sum(sizes):
            raise ValueError(f"{path} holds {flat.size} values, the model has {sum(sizes)}")
        return [part.reshape(s) for part, s in zip(np.split(flat, np.cumsum(sizes)[:-1]), self.shapes)]

    def save(self, client: str, residual: list[np.ndarray] | None) -> None:
        """Keep ``client``'s residual (None: forget it)."""
        if residual is None:  # a plain round's: nothing to keep, and most clients have no file to remove
            if client in self._kept:
                self._path(client).unlink(missing_ok=True)
                self._kept.discard(client)
            return
        path = self._path(client)
        flat = np.concatenate([np.asarray(r, np.float32).ravel() for r in residual])
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, flat, allow_pickle=False)
        tmp.replace(path)
        self._kept.add(client)

    def __len__(self) -> int:
        return len(self._kept)

    def close(self) -> None:
        """Remove the folder if this store made it."""
        if self._own:
            shutil.rmtree(self.folder, ignore_errors=True)
