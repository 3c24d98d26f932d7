"""DCP checkpoints hold nothing pickled: they round-trip every dtype and plain item, never call pickle or torch.save /
torch.load, and a tampered, damaged or pickled folder is refused with its reason, without running anything."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from fedpar.parallel import dcp_storage
from fedpar.parallel.checkpoint import latest_checkpoint
from fedpar.parallel.dcp_storage import UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _Planted:
    """Unpickling this creates a file: the stand-in for arbitrary code in a hostile checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    return {"w": torch.randn(4, 3), "half": torch.randn(5).to(torch.bfloat16), "flag": torch.tensor(True),
            "step": torch.tensor(7), "empty": torch.zeros(0, 3), "strided": torch.randn(3, 4).t(),
            "hyper": {"lr": 0.1, "betas": (0.9, 0.999), "foreach": None, "names": ["a", 2, [{"in": (1,)}]],
                      "nested": {"k": (1,)}, "inf": float("inf")}}


def _blank() -> dict[str, object]:
    return {"w": torch.zeros(4, 3), "half": torch.zeros(5, dtype=torch.bfloat16), "flag": torch.tensor(False),
            "step": torch.tensor(0), "empty": torch.ones(0, 3), "strided": torch.zeros(4, 3),
            "hyper": {"lr": 0.0, "betas": (0.0, 0.0), "foreach": True, "names": ["b", 0, [{"in": (0,)}]],
                      "nested": {"k": (0,)}, "inf": 0.0}}


def _save(path: Path, state: dict[str, object]) -> None:
    dcp_storage.save(state, path, no_dist=True)


def _load(path: Path, into: dict[str, object]) -> None:
    dcp_storage.load(into, path, no_dist=True)


def _metadata(path: Path) -> dict:
    return json.loads((path / ".metadata").read_bytes())


def _write_metadata(path: Path, doc: dict) -> None:
    (path / ".metadata").write_text(json.dumps(doc))


def test_every_dtype_and_plain_item_comes_back_as_it_was_saved(tmp_path: Path) -> None:
    saved, into = _state(), _blank()
    _save(tmp_path / "ck", saved)
    _load(tmp_path / "ck", into)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert into[key].dtype == value.dtype and torch.equal(into[key], value), key
    assert into["hyper"] == saved["hyper"] and isinstance(into["hyper"]["betas"], tuple)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".metadata", "__0_0.distcp"]


def test_saving_and_loading_never_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was called")

    for module, name in ((pickle, "dump"), (pickle, "dumps"), (pickle, "load"), (pickle, "loads"), (pickle, "Pickler"),
                         (pickle, "Unpickler"), (torch, "save"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    into = _blank()
    _save(tmp_path / "ck", _state())
    _load(tmp_path / "ck", into)
    assert torch.equal(into["w"], _state()["w"])
    doc = _metadata(tmp_path / "ck")  # the metadata is JSON, naming each stored part's bytes
    assert doc["format"] == "fedpar-dcp" and {p["fqn"] for p in doc["parts"]} >= {"w", "hyper.betas"}


def test_a_pickled_metadata_file_is_refused_without_running_it(tmp_path: Path) -> None:
    _save(tmp_path / "ck", _state())
    marker = tmp_path / "pwned"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(UnsafeCheckpointError, match="its metadata is pickled .* which fedpar does not read"):
        _load(tmp_path / "ck", _blank())
    assert not marker.exists()
    # The reader refuses when DCP itself calls it, too
    with pytest.raises(CheckpointException):
        dcp.load(_blank(), storage_reader=dcp_storage.PlainFileSystemReader(str(tmp_path / "ck")),
                 planner=dcp_storage.PlainLoadPlanner(), no_dist=True)
    assert not marker.exists()


@pytest.mark.parametrize("change, said", [
    (lambda doc: doc["parts"][0].update(file="../../elsewhere.distcp"), "outside the checkpoint folder"),
    (lambda doc: doc["parts"][0].update(file="/etc/passwd"), "outside the checkpoint folder"),
    (lambda doc: doc["items"]["w"].update(dtype="object"), "dtype 'object', which is not one of torch's"),
    (lambda doc: [p.update(length=p["length"] + 4) for p in doc["parts"] if p["fqn"] == "w"],
     "gives w 52 bytes for a float32 chunk of shape \\[4, 3\\]"),
    (lambda doc: doc["items"]["w"].update(size=[4, -3]), "where sizes belong"),
    (lambda doc: doc.update(format="other"), "not a fedpar checkpoint's"),
    (lambda doc: doc.update(version=99), "format version 99"),
    (lambda doc: doc.update(byteorder="middle"), "stored middle-endian and this machine is"),
    (lambda doc: doc.pop("parts"), "damaged"),
])
def test_tampered_metadata_is_refused_with_its_reason(tmp_path: Path, change, said: str) -> None:
    _save(tmp_path / "ck", _state())
    doc = _metadata(tmp_path / "ck")
    change(doc)
    _write_metadata(tmp_path / "ck", doc)
    with pytest.raises(UnsafeCheckpointError, match=said):
        _load(tmp_path / "ck", _blank())


def test_cut_or_reshaped_files_are_refused(tmp_path: Path) -> None:
    _save(tmp_path / "ck", _state())
    raw = (tmp_path / "ck" / ".metadata").read_bytes()
    (tmp_path / "ck" / ".metadata").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(UnsafeCheckpointError, match="damaged"):
        _load(tmp_path / "ck", _blank())
    (tmp_path / "ck" / ".metadata").write_bytes(raw)
    shard = tmp_path / "ck" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(UnsafeCheckpointError, match="ends before .* it is damaged"):
        _load(tmp_path / "ck", _blank())
    _save(tmp_path / "ck2", _state())
    into = _blank()
    into["w"] = torch.zeros(3, 4)  # another model's shape
    with pytest.raises(UnsafeCheckpointError):
        _load(tmp_path / "ck2", into)


def test_a_part_claimed_longer_than_its_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    _save(tmp_path / "ck", {"w": torch.ones(2), "item": 1})
    doc = _metadata(tmp_path / "ck")
    next(p for p in doc["parts"] if p["fqn"] == "item")["length"] = 1 << 50  # a petabyte: never allocated
    _write_metadata(tmp_path / "ck", doc)
    with pytest.raises(UnsafeCheckpointError, match="ends before item .* its metadata says 1125899906842"):
        _load(tmp_path / "ck", {"w": torch.zeros(2), "item": None})


def test_bytes_changed_inside_a_file_are_refused_by_their_checksum(tmp_path: Path) -> None:
    _save(tmp_path / "ck", _state())
    shard = tmp_path / "ck" / "__0_0.distcp"
    part = next(p for p in _metadata(tmp_path / "ck")["parts"] if p["fqn"] == "w")
    data = bytearray(shard.read_bytes())
    data[part["at"] + 5] ^= 0x40  # one bit of one weight: same size, the value still a float
    shard.write_bytes(bytes(data))
    with pytest.raises(UnsafeCheckpointError, match="does not hold the bytes its metadata says for w .* damaged"):
        _load(tmp_path / "ck", _blank())


def test_a_plain_item_rewritten_with_its_checksum_is_still_read_as_json_only(tmp_path: Path) -> None:
    _save(tmp_path / "ck", {"w": torch.ones(2), "item": 1})
    shard = tmp_path / "ck" / "__0_0.distcp"
    doc = _metadata(tmp_path / "ck")
    part = next(p for p in doc["parts"] if p["fqn"] == "item")
    forged = b"{" + b" " * (part["length"] - 1)
    data = bytearray(shard.read_bytes())
    data[part["at"]:part["at"] + part["length"]] = forged
    shard.write_bytes(bytes(data))
    part["crc32"] = zlib.crc32(forged)  # a forger keeps the metadata in step
    _write_metadata(tmp_path / "ck", doc)
    with pytest.raises(UnsafeCheckpointError, match="checkpoint item item is not plain data"):
        _load(tmp_path / "ck", {"w": torch.zeros(2), "item": None})


def test_an_item_that_is_not_plain_data_is_refused_as_it_is_saved(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(CheckpointException, match="checkpoint item item is a _Planted"):
        _save(tmp_path / "ck", {"w": torch.ones(2), "item": _Planted(marker)})
    assert not (tmp_path / "ck" / ".metadata").exists() and not marker.exists()


def test_dcps_own_default_format_is_what_this_replaces(tmp_path: Path) -> None:
    """The threat is real: a folder in DCP's own format runs a planted call as DCP's default planner loads it."""
    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(2), "item": _Planted(marker)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="pickled"):
        _load(tmp_path / "ck", {"w": torch.zeros(2), "item": None})
    assert not marker.exists()
    dcp.load({"w": torch.zeros(2), "item": None}, checkpoint_id=str(tmp_path / "ck"), planner=DefaultLoadPlanner(),
             no_dist=True)
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


def test_the_benchmarks_quick_run_saves_and_loads_both_formats(tmp_path: Path) -> None:
    """benchmarks/dcp_storage_bench.py --quick: both formats round-trip the state and the ratios are written."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "dcp_storage_bench.py"
    spec = importlib.util.spec_from_file_location("dcp_storage_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--json", str(tmp_path / "bench.json")]) == 0
    written = json.loads((tmp_path / "bench.json").read_text())
    assert [r["what"].split(" ")[0] for r in written["ratios"]] == ["save", "load"]
    assert all(r["ratio"] > 0 for r in written["ratios"]) and written["results"]["repeats"] == 2
