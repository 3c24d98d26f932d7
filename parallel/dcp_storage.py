"""torch.distributed.checkpoint (DCP) folders with nothing pickled in them.

DCP's own file storage pickles its ``.metadata``, writes every tensor with ``torch.save`` (a pickle in a zip) and
every non-tensor item too, and its default planner unpickles those items without restriction: a folder copied from
elsewhere could run code as it loads. fedpar keeps DCP's planning (which rank writes which shard, resharding on
load) and stores the parts itself:
- ``.metadata`` is JSON (:func:`metadata_json`, :func:`metadata_from_json`): the items, their chunks and dtypes,
  and where each stored part lies;
- a tensor is its raw bytes (the chunk in row-major order, in the byte order the metadata names), one file per
  rank;
- a non-tensor item (an optimizer's hyper-parameter) is JSON: numbers, text, booleans, None, lists, tuples and
  dicts with text keys; anything else is refused as the checkpoint is written.
Reading checks what it reads: the format, dtypes from torch's own list, sizes that agree with the bytes, files
inside the checkpoint folder, no short read, each part's CRC-32 (as a zip file keeps one per member, so damage inside
a file is found too). Anything else is an :class:`UnsafeCheckpointError`.
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import sys
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

FORMAT = "fedpar-dcp"
VERSION = 1
MAX_METADATA_BYTES = 256 << 20
_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_MEMORY_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
                   if isinstance(v, torch.memory_format)}


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something fedpar never writes (damaged, tampered with, or not fedpar's checkpoint)."""


@dataclass(frozen=True)
class StoredPart:
    """Where one stored item lies: ``length`` bytes at ``offset`` of ``relative_path`` in the checkpoint folder, whose
    CRC-32 is ``crc32``; a tensor's chunk also says its ``dtype`` and ``shape`` (None for a JSON item)."""

    relative_path: str
    offset: int
    length: int
    crc32: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


# ---- non-tensor items: JSON with tuples kept as tuples ----

def encode_item(value: Any, name: str = "item") -> bytes:
    """A non-tensor checkpoint item as JSON bytes; ValueError naming ``name`` when it is not plain data."""
    return json.dumps(_plain(value, name), allow_nan=True).encode()


def decode_item(raw: bytes, name: str = "item") -> Any:
    """The value :func:`encode_item` wrote; UnsafeCheckpointError when the bytes are not that."""
    try:
        return _unplain(json.loads(raw))
    except (ValueError, TypeError, KeyError) as exc:
        raise UnsafeCheckpointError(f"checkpoint item {name} is not plain data ({type(exc).__name__}: {exc}); "
                                    "refusing to load it") from None


def _plain(value: Any, name: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_plain(v, name) for v in value]}
    if isinstance(value, list):
        return [_plain(v, name) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _plain(v, name) for k, v in value.items()}}
    raise ValueError(f"checkpoint item {name} is a {type(value).__name__}; a checkpoint keeps tensors and plain data "
                     "(numbers, text, booleans, None, lists, tuples, dicts with text keys)")


def _unplain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict) and set(value) == {"tuple"} and isinstance(value["tuple"], list):
        return tuple(_unplain(v) for v in value["tuple"])
    if isinstance(value, dict) and set(value) == {"dict"} and isinstance(value["dict"], dict):
        return {k: _unplain(v) for k, v in value["dict"].items()}
    raise ValueError(f"unexpected {type(value).__name__} {str(value)[:60]}")


class PlainSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, handing non-tensor items to the writer as JSON instead of ``torch.save``."""

    def transform_object(self, write_item: WriteItem, object: Any):  # noqa: A002 (DCP's parameter name)
        """A non-tensor item as JSON bytes; a tensor as it is."""
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(encode_item(object, write_item.index.fqn))
        return object


class PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items as the JSON :class:`PlainSavePlanner` wrote."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Put one non-tensor item (e.g. an optimizer's hyper-parameter) where the state dict has it."""
        loaded = decode_item(value.read(), read_item.dest_index.fqn)
        # As DefaultLoadPlanner.load_bytes places what it unpickles.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# ---- the metadata as JSON ----

def metadata_json(metadata: Metadata) -> bytes:
    """``metadata`` (its items, the planner's paths and where every part is stored) as JSON bytes."""
    items = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            items[fqn] = {"bytes": True}
            continue
        p = md.properties
        items[fqn] = {"dtype": _dtype_name(p.dtype), "size": list(md.size), "requires_grad": bool(p.requires_grad),
                      "memory_format": str(p.memory_format).removeprefix("torch."), "pin_memory": bool(p.pin_memory),
                      "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks]}
    parts = [{"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
              "index": index.index, "file": part.relative_path, "at": part.offset, "length": part.length,
              "crc32": part.crc32, "dtype": part.dtype, "shape": None if part.shape is None else list(part.shape)}
             for index, part in (metadata.storage_data or {}).items()]
    planner = metadata.planner_data
    meta = metadata.storage_meta
    return json.dumps({
        "format": FORMAT, "version": VERSION, "dcp_version": metadata.version, "byteorder": sys.byteorder,
        "items": items, "parts": parts,
        "planner_data": None if planner is None else {k: list(v) for k, v in planner.items()},
        "storage_meta": None if meta is None else {"checkpoint_id": None if meta.checkpoint_id is None
                                                   else str(meta.checkpoint_id),
                                                   "save_id": meta.save_id, "modules": list(meta.modules)},
    }).encode()


def metadata_from_json(raw: bytes) -> Metadata:
    """The Metadata :func:`metadata_json` wrote; UnsafeCheckpointError, saying why, for anything else."""
    if raw[:1] == b"\x80":  # pickle's first byte: DCP's own format, as fedpar wrote it before
        raise UnsafeCheckpointError("its metadata is pickled (torch's own format, as fedpar wrote checkpoints "
                                    "before 2026-11-29), which fedpar does not read")
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise UnsafeCheckpointError("its metadata is not a fedpar checkpoint's")
        if doc.get("version") != VERSION:
            raise UnsafeCheckpointError(f"its metadata is of format version {doc.get('version')!r}; this fedpar "
                                        f"reads version {VERSION}")
        if doc.get("byteorder") != sys.byteorder:
            raise UnsafeCheckpointError(f"its tensors are stored {doc.get('byteorder')}-endian and this machine is "
                                        f"{sys.byteorder}-endian")
        metadata = Metadata(state_dict_metadata={fqn: _item_metadata(md) for fqn, md in doc["items"].items()},
                            planner_data=None if doc["planner_data"] is None else
                            {str(k): tuple(_path_part(p) for p in v) for k, v in doc["planner_data"].items()},
                            storage_data={_index(p): _part(p) for p in doc["parts"]},
                            storage_meta=None if doc["storage_meta"] is None else _storage_meta(doc["storage_meta"]),
                            version=doc.get("dcp_version"))
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # a malformed document: any shape of it
        raise UnsafeCheckpointError(f"checkpoint metadata is damaged ({type(exc).__name__}: {exc})") from None
    return metadata


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise UnsafeCheckpointError(f"checkpoint metadata names dtype {name!r}, which is not one of torch's")
    return _DTYPES[name]


def _sizes(values: Any) -> torch.Size:
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise UnsafeCheckpointError(f"checkpoint metadata holds {values!r} where sizes belong")
    return torch.Size(values)


def _item_metadata(md: dict) -> TensorStorageMetadata | BytesStorageMetadata:
    if md.get("bytes") is True:
        return BytesStorageMetadata()
    memory_format = _MEMORY_FORMATS.get(md["memory_format"])
    if memory_format is None:
        raise UnsafeCheckpointError(f"checkpoint metadata names memory format {md['memory_format']!r}")
    properties = TensorProperties(dtype=_dtype(md["dtype"]), requires_grad=bool(md["requires_grad"]),
                                  memory_format=memory_format, pin_memory=bool(md["pin_memory"]))
    return TensorStorageMetadata(properties=properties, size=_sizes(md["size"]),
                                 chunks=[ChunkStorageMetadata(offsets=_sizes(c["offsets"]), sizes=_sizes(c["sizes"]))
                                         for c in md["chunks"]])


def _path_part(part: Any) -> str | int:
    if type(part) not in (str, int):
        raise UnsafeCheckpointError(f"checkpoint metadata holds {part!r} in a state-dict path")
    return part


def _index(p: dict) -> MetadataIndex:
    index = p["index"]
    if index is not None and type(index) is not int:
        raise UnsafeCheckpointError(f"checkpoint metadata holds {index!r} as a chunk's index")
    return MetadataIndex(fqn=str(p["fqn"]), offset=None if p["offset"] is None else _sizes(p["offset"]), index=index)


def _part(p: dict) -> StoredPart:
    name, at, length, crc = p["file"], p["at"], p["length"], p["crc32"]
    path = pathlib.PurePath(str(name))
    if not isinstance(name, str) or len(path.parts) != 1 or path.name in ("", ".", ".."):
        raise UnsafeCheckpointError(f"checkpoint metadata points at {name!s}, outside the checkpoint folder")
    if not all(type(v) is int and v >= 0 for v in (at, length, crc)):
        raise UnsafeCheckpointError(f"checkpoint metadata holds a part at {at!r} of length {length!r}, CRC {crc!r}")
    if p["dtype"] is None:
        return StoredPart(name, at, length, crc)
    dtype, shape = _dtype(p["dtype"]), _sizes(p["shape"])
    if math.prod(shape) * dtype.itemsize != length:
        raise UnsafeCheckpointError(f"checkpoint metadata gives {p['fqn']} {length} bytes for a {p['dtype']} "
                                    f"chunk of shape {list(shape)}")
    return StoredPart(name, at, length, crc, p["dtype"], tuple(shape))


def _storage_meta(meta: dict) -> StorageMeta:
    return StorageMeta(checkpoint_id=meta["checkpoint_id"], save_id=meta["save_id"],
                       modules=[str(m) for m in meta["modules"]])


# ---- the files ----

class PlainFileSystemWriter(FileSystemWriter):
    """DCP's file writer (its plan: one file per rank, metadata by the coordinator) storing tensors as raw bytes and
    the metadata as JSON."""

    def write_data(self, plan, planner) -> Future[list[WriteResult]]:
        """Write this rank's items into one file, in the plan's order: a tensor chunk's bytes or an item's JSON."""
        file_name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        with open(self.fs.concat_path(self.path, file_name), "wb") as stream:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw, dtype, shape = data.getbuffer(), None, None
                else:
                    tensor = data.detach().cpu().contiguous()
                    raw = tensor.reshape(-1).view(torch.uint8).numpy()
                    dtype, shape = _dtype_name(tensor.dtype), tuple(tensor.shape)
                offset = stream.tell()
                stream.write(raw)
                part = StoredPart(file_name, offset, stream.tell() - offset, zlib.crc32(raw), dtype, shape)
                results.append(WriteResult(index=item.index, size_in_bytes=part.length, storage_data=part))
            stream.flush()
            if self.sync_files:
                os.fsync(stream.fileno())
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata`` as JSON, whole under another name first."""
        metadata.version = CURRENT_DCP_VERSION  # as DCP's writer sets it: the planners read older layouts by it
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        metadata.storage_meta = self.storage_meta()
        per_rank = not self.use_collectives and self.rank is not None  # as DCP names it
        final = pathlib.Path(self._get_metadata_path(self.rank if per_rank else None))
        staged = final.with_name(final.name + ".tmp")
        with open(staged, "wb") as stream:
            stream.write(metadata_json(metadata))
            stream.flush()
            if self.sync_files:
                os.fsync(stream.fileno())
        os.replace(staged, final)


class PlainFileSystemReader(FileSystemReader):
    """Reads what :class:`PlainFileSystemWriter` wrote, checking it as it goes (see the module's docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read and check ``.metadata``; refuse oversized or foreign content with UnsafeCheckpointError."""
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            raw = stream.read(MAX_METADATA_BYTES + 1)
        if len(raw) > MAX_METADATA_BYTES:
            raise UnsafeCheckpointError(f"{path} is larger than {MAX_METADATA_BYTES} bytes; not a DCP metadata file")
        metadata = metadata_from_json(raw)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner) -> Future[None]:
        """Read every planned item from its file and hand it to the planner."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            with open(self.fs.concat_path(self.path, name), "rb") as stream:
                for item in items:
                    part: StoredPart = self.storage_data[item.storage_index]
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(_read(stream, name, item, part)))
                    else:
                        planner.commit_tensor(item, _tensor_into(stream, name, item, part, planner))
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _read(stream, name: str, item: ReadItem, part: StoredPart, into=None) -> Any:
    """The part's bytes, checked, in ``into`` (a writable buffer of ``part.length`` bytes; a new bytearray if
    None); ``into``."""
    size = os.fstat(stream.fileno()).st_size
    if part.offset + part.length > size:  # before any buffer of the length the metadata claims is made
        raise UnsafeCheckpointError(f"checkpoint file {name} ends before {item.storage_index.fqn} ({size} bytes; "
                                    f"its metadata says {part.offset + part.length}): it is damaged")
    into = bytearray(part.length) if into is None else into
    stream.seek(part.offset)
    got = stream.readinto(into)
    if got != part.length:
        raise UnsafeCheckpointError(f"checkpoint file {name} ends before {item.storage_index.fqn} (read {got} of "
                                    f"{part.length} bytes): it is damaged")
    if zlib.crc32(into) != part.crc32:
        raise UnsafeCheckpointError(f"checkpoint file {name} does not hold the bytes its metadata says for "
                                    f"{item.storage_index.fqn} (CRC-32): it is damaged")
    return into


def _tensor_into(stream, name: str, item: ReadItem, part: StoredPart, planner) -> torch.Tensor:
    """The planner's tensor for ``item`` holding this rank's share of the stored chunk."""
    fqn = item.storage_index.fqn
    if part.dtype is None:
        raise UnsafeCheckpointError(f"checkpoint item {fqn} is stored as data, not a tensor")
    dtype = _dtype(part.dtype)
    target = planner.resolve_tensor(item).detach()
    if (target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
            and tuple(target.shape) == part.shape and not any(item.storage_offsets)):  # a resume on the same layout
        _read(stream, name, item, part, target.reshape(-1).view(torch.uint8).numpy())  # straight into its memory
        return target
    raw = _read(stream, name, item, part)
    chunk = (torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)).reshape(part.shape)
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):  # this rank's share of it
        chunk = chunk.narrow(dim, start, length)
    if target.size() != chunk.size():
        raise UnsafeCheckpointError(f"checkpoint item {fqn} has shape {list(chunk.size())} where this run's has "
                                    f"{list(target.size())}")
    target.copy_(chunk)
    return target


# ---- save and load ----

def save(state_dict: dict[str, Any], path: str | pathlib.Path, **dcp_kwargs: Any) -> None:
    """``dcp.save`` of ``state_dict`` into the folder ``path``, in this module's format."""
    dcp.save(state_dict, storage_writer=PlainFileSystemWriter(str(path)), planner=PlainSavePlanner(), **dcp_kwargs)


def load(state_dict: dict[str, Any], path: str | pathlib.Path, **dcp_kwargs: Any) -> None:
    """``dcp.load`` of the checkpoint folder ``path`` into ``state_dict`` (in place), through the checking reader;
    what fails on any rank raises as one UnsafeCheckpointError, a stop as itself."""
    reader = PlainFileSystemReader(str(path))
    # Check .metadata before DCP does, so a refusal raises UnsafeCheckpointError with its reason: torch 2.11's
    # dcp.load catches any read_metadata error and reports only "metadata is None" (2.13 keeps the message).
    reader.read_metadata()
    try:
        dcp.load(state_dict, storage_reader=reader, planner=PlainLoadPlanner(), **dcp_kwargs)
    except CheckpointException as exc:  # a BaseException, which would end a rank past every handler
        raise_wrapped_stop(exc)
        rank, (first, _) = next(iter(sorted(exc.failures.items())))
        if isinstance(first, UnsafeCheckpointError):  # the reader's or the planner's refusal, as it said it
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
    """The first sentence of what ``exc`` says (torch's errors run on to several lines of advice)."""
    return (str(exc).strip().splitlines() or [""])[0].split(". ")[0]
