"""DCP checkpoints are read without running pickled code: tampered metadata, items and pointers are refused.

``safe_load`` refuses bad metadata itself (UnsafeCheckpointError), and a planner's refusal, which DCP wraps in a
CheckpointException, or a file that does not read, as UnsafeCheckpointError too.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from fedpar.parallel.checkpoint import latest_checkpoint
from fedpar.parallel.safe_dcp import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_metadata_bytes,
    safe_load,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _Planted:
    """Unpickling this creates a file: the stand-in for arbitrary code in a hostile checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    return {"w": torch.randn(4, 3), "hyper": {"lr": 0.1, "betas": (0.9, 0.999), "foreach": None}}


def _save(path: Path, state: dict[str, object]) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _safe_load(path: Path, into: dict[str, object]) -> None:
    safe_load(into, path, no_dist=True)


def test_safe_reader_loads_what_dcp_wrote(tmp_path: Path) -> None:
    saved = _state()
    _save(tmp_path / "ck", saved)
    into = {"w": torch.zeros(4, 3), "hyper": {"lr": 0.0, "betas": (0.0, 0.0), "foreach": True}}
    _safe_load(tmp_path / "ck", into)
    assert torch.equal(into["w"], saved["w"])
    assert into["hyper"] == {"lr": 0.1, "betas": (0.9, 0.999), "foreach": None}


def test_metadata_naming_a_foreign_callable_is_refused_without_running_it(tmp_path: Path) -> None:
    _save(tmp_path / "ck", _state())
    marker = tmp_path / "pwned"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(UnsafeCheckpointError, match="names _?io.open, which torch.distributed.checkpoint never writes"):
        _safe_load(tmp_path / "ck", _state())
    assert not marker.exists()
    # The reader refuses when DCP itself calls it, too (torch 2.11 then reports only "metadata is None").
    with pytest.raises(CheckpointException):
        dcp.load(_state(), storage_reader=SafeFileSystemReader(str(tmp_path / "ck")), planner=SafeLoadPlanner(),
                 no_dist=True)
    assert not marker.exists()


def test_metadata_pointing_outside_the_folder_or_damaged_is_refused(tmp_path: Path) -> None:
    _save(tmp_path / "ck", _state())
    raw = (tmp_path / "ck" / ".metadata").read_bytes()
    metadata = load_metadata_bytes(raw)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint folder"):
        load_metadata_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="damaged"):
        load_metadata_bytes(raw[: len(raw) // 2])
    with pytest.raises(UnsafeCheckpointError, match="not DCP Metadata"):
        load_metadata_bytes(pickle.dumps({"a": 1}))


def test_non_tensor_item_holding_code_is_refused_where_dcp_default_would_run_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _save(tmp_path / "ck", {"w": torch.ones(2), "item": _Planted(marker)})
    with pytest.raises(UnsafeCheckpointError, match="item item is not plain data"):
        _safe_load(tmp_path / "ck", {"w": torch.zeros(2), "item": None})
    assert not marker.exists()
    # The threat is real: DCP's own planner runs the planted call.
    dcp.load({"w": torch.zeros(2), "item": None}, checkpoint_id=str(tmp_path / "ck"),
             planner=DefaultLoadPlanner(), no_dist=True)
    assert marker.exists()


@pytest.mark.parametrize("pointer", ["/etc", "../step-00000001", "step-1", "step-00000001/../../x"])
def test_latest_pointer_must_name_a_step_folder_beside_it(tmp_path: Path, pointer: str) -> None:
    (tmp_path / "latest").write_text(pointer + "\n")
    with pytest.raises(UnsafeCheckpointError, match="not a step-NNNNNNNN folder"):
        latest_checkpoint(tmp_path)


def test_latest_pointer_to_a_missing_checkpoint_is_refused(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "latest").write_text("step-00000003\n")
    with pytest.raises(UnsafeCheckpointError, match="names step-00000003, which holds no complete checkpoint"):
        latest_checkpoint(tmp_path)  # a resume would start afresh in silence
    os.makedirs(tmp_path / "step-00000003")
    (tmp_path / "step-00000003" / ".metadata").write_bytes(b"")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000003"
