"""Reading torch.distributed.checkpoint (DCP) folders without running arbitrary pickled code.

DCP writes its ``.metadata`` with ``pickle`` and reads it back with ``pickle.load``, and its default planner
reads non-tensor items with ``torch.load(weights_only=False)``: a checkpoint folder copied from elsewhere
could run code on load. ``SafeFileSystemReader`` unpickles the metadata with an allow-list of the classes DCP
itself writes (the restricted-``find_class`` pattern of Python's pickle documentation) and refuses storage
entries that point outside the folder; ``SafeLoadPlanner`` reads non-tensor items with ``weights_only=True``.
Tensor data is already read with ``weights_only=True`` by DCP. ``safe_load`` is ``dcp.load`` through both, and
raises what fails on any rank as one UnsafeCheckpointError (DCP's own CheckpointException is a BaseException), and a
stop (SIGINT, SIGTERM) that DCP caught as the stop itself (``raise_wrapped_stop``, for ``dcp.save`` too).
"""

from __future__ import annotations

import enum
import io
import pathlib
import pickle
from dataclasses import is_dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

MAX_METADATA_BYTES = 256 << 20


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something DCP never writes (tampered with, or not a DCP checkpoint)."""


def _allowed(module: str, name: str) -> Any | None:
    if module == dcp_metadata.__name__:
        obj = getattr(dcp_metadata, name, None)
        return obj if isinstance(obj, type) and (is_dataclass(obj) or issubclass(obj, enum.Enum)) else None
    if (module, name) == (_StorageInfo.__module__, "_StorageInfo"):
        return _StorageInfo
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj if name == "Size" or isinstance(obj, (torch.dtype, torch.memory_format)) else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout
    if module in ("pathlib", "pathlib._local") and name in ("PosixPath", "WindowsPath", "PurePosixPath",
                                                           "PureWindowsPath", "Path"):  # _local: Python 3.13+
        return getattr(pathlib, name)
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise UnsafeCheckpointError(
                f"checkpoint metadata names {module}.{name}, which torch.distributed.checkpoint never writes; "
                "refusing to load it (the folder may have been tampered with: use a checkpoint your own run wrote)")
        return found


def load_metadata_bytes(raw: bytes) -> dcp_metadata.Metadata:
    """Unpickle DCP metadata allowing only the classes DCP writes; anything else raises UnsafeCheckpointError."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise UnsafeCheckpointError(f"checkpoint metadata is damaged ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"checkpoint metadata holds a {type(metadata).__name__}, not DCP Metadata")
    for info in (metadata.storage_data or {}).values():
        path = pathlib.PurePath(str(getattr(info, "relative_path", "")))
        if not isinstance(info, _StorageInfo) or len(path.parts) != 1 or path.name in ("", ".", ".."):
            raise UnsafeCheckpointError(f"checkpoint metadata points at {path!s}, outside the checkpoint folder")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A DCP FileSystemReader whose metadata is unpickled with an allow-list and checked (see module doc)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """Read and check ``.metadata``; refuse oversized or foreign content with UnsafeCheckpointError."""
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            raw = stream.read(MAX_METADATA_BYTES + 1)
        if len(raw) > MAX_METADATA_BYTES:
            raise UnsafeCheckpointError(f"{path} is larger than {MAX_METADATA_BYTES} bytes; not a DCP metadata file")
        metadata = load_metadata_bytes(raw)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load one non-tensor item (e.g. an optimizer hyper-parameter) without arbitrary unpickling."""
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"checkpoint item {read_item.dest_index.fqn} is not plain data ({_first_line(exc)}); "
                "refusing to load it") from exc
        # The same as DefaultLoadPlanner.load_bytes, which loads with weights_only=False.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def safe_load(state_dict: dict[str, Any], path: str | pathlib.Path, **dcp_kwargs: Any) -> None:
    """``dcp.load`` of the checkpoint folder ``path`` through the safe reader and planner (in place)."""
    reader = SafeFileSystemReader(str(path))
    # Check .metadata before DCP does, so a refusal raises UnsafeCheckpointError with its reason: torch 2.11's
    # dcp.load catches any read_metadata error and reports only "metadata is None" (2.13 keeps the message).
    reader.read_metadata()
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), **dcp_kwargs)
    except CheckpointException as exc:  # a BaseException, which would end a rank past every handler
        raise_wrapped_stop(exc)
        rank, (first, _) = next(iter(sorted(exc.failures.items())))
        if isinstance(first, UnsafeCheckpointError):  # the planner's refusal, as it said it
            raise first from None
        raise UnsafeCheckpointError(f"checkpoint {path} could not be read (rank {rank}: {type(first).__name__}: "
                                    f"{_first_line(first)}): it is damaged, or another run's settings wrote it"
                                    ) from None


def raise_wrapped_stop(exc: CheckpointException) -> None:
    """Raise, as itself, a stop (SIGINT, SIGTERM: a KeyboardInterrupt) that DCP caught on a rank and wrapped in exc."""
    for rank in sorted(exc.failures):
        failure = exc.failures[rank][0]
        if isinstance(failure, KeyboardInterrupt):
            raise failure from None


def _first_line(exc: BaseException) -> str:
    """The first sentence of what ``exc`` says (torch's load errors run on to several lines of advice)."""
    return (str(exc).strip().splitlines() or [""])[0].split(". ")[0]
