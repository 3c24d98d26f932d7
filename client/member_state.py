"""What a virtual client keeps from one round to the next, kept off the heap: its top-k error-feedback residual.

A residual is as large as the model, and only clients that were ever sampled have one, so a host keeps them in a
folder, one ``.npy`` file per client (the residual flattened to float32; read back with ``allow_pickle=False``).
Memory stays one residual per seat whatever the population; the disk holds one model per client sampled so far.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np


class ResidualNotKept(OSError):
    """A client's residual could not be written (a full disk, a folder gone): it is forgotten, so the client's error
    feedback starts again from zero, as a new client's does."""


class ResidualStore:
    """Per-client residuals in a folder (unless ``folder`` is given, a temporary one made at the first save: a host
    whose rounds keep no residual, as plain FedAvg's, leaves nothing behind even if it is killed); :meth:`close`
    removes a temporary one."""

    def __init__(self, shapes: list[tuple[int, ...]], folder: str | Path | None = None):
        self.shapes = [tuple(s) for s in shapes]
        self._own = folder is None
        self._making = threading.Lock()  # a host's seats save at once: the first saves must make one folder, not two
        self.folder = None if folder is None else Path(folder)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        # who has a file: no disk call for the rest
        self._kept = set() if self.folder is None else {path.stem for path in self.folder.glob("*.npy")}

    def _path(self, client: str) -> Path:
        if self.folder is None:
            with self._making:
                if self.folder is None:
                    self.folder = Path(tempfile.mkdtemp(prefix="fedpar-residuals-"))
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
            self._forget(client)
            return
        flat = np.concatenate([np.asarray(r, np.float32).ravel() for r in residual])
        try:
            path = self._path(client)
            tmp = path.with_suffix(".tmp.npy")
            try:
                np.save(tmp, flat, allow_pickle=False)
                tmp.replace(path)
            except OSError:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)  # a part written before the disk filled up
                raise
        except OSError as err:
            self._forget(client)  # an older residual must not come back in its place
            # numpy says a short write as "N requested and M written", with no errno
            detail = err.strerror or f"{err} (is the disk full?)"
            raise ResidualNotKept(f"cannot keep {client}'s residual in {self.folder}: {detail}") from None
        self._kept.add(client)

    def _forget(self, client: str) -> None:
        """``client`` has no residual from here on (a file that cannot be removed is not read again)."""
        if client in self._kept:
            self._kept.discard(client)
            with contextlib.suppress(OSError):
                self._path(client).unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._kept)

    def close(self) -> None:
        """Remove the folder if this store made it."""
        if self._own and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
