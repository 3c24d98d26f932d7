"""The checkpoint writer survives a crash between any two steps; damaged checkpoints fail clearly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedpar.server import checkpoint as ck
from fedpar.server.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from fedpar.server.registry import AgentRegistry, AuthError
from fedpar.server.members import CohortSampler


def _ckpt(round_id: int, seed: int = 0) -> Checkpoint:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)]
    sampler = CohortSampler(seed)
    return Checkpoint(round_id, ["w", "b"], arrays, {"m": np.arange(4, dtype=np.float64)},
                      {"sampler": sampler.state(), "strategy": {"strategy": "fedavg"},
                       "example_caps": {"a": 7},
                       "metrics_row": {"round": round_id, "status": "ok"}})


def _same(a: Checkpoint, b: Checkpoint) -> bool:
    return (a.round_id == b.round_id and a.names == b.names
            and [x.tobytes() for x in a.arrays] == [y.tobytes() for y in b.arrays])


class Crash(BaseException):
    """Stands for the process dying at this point."""


STEPS = ["save_tensors", "atomic_write_bytes", "fsync_directory"]


@pytest.mark.parametrize("step,nth", [("save_tensors", 1), ("save_tensors", 2), ("atomic_write_bytes", 1),
                                      ("fsync_directory", 1), ("atomic_write_bytes", 2)])
def test_a_crash_between_steps_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, step, nth):
    first = _ckpt(1, seed=1)
    save_checkpoint(tmp_path, first)
    real = getattr(ck, step)
    calls = []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            raise Crash(step)
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, step, dying)
    with pytest.raises(Crash):
        save_checkpoint(tmp_path, _ckpt(2, seed=2))
    monkeypatch.setattr(ck, step, real)
    # The last write of all (LATEST itself) is atomic: either the old or the new pointer, never a torn one.
    loaded = load_checkpoint(tmp_path)
    assert _same(loaded, first), step
    # The next save clears the leftovers and publishes normally.
    second = _ckpt(2, seed=2)
    save_checkpoint(tmp_path, second)
    assert _same(load_checkpoint(tmp_path), second)
    assert not list(tmp_path.glob(".*"))


def test_leftover_partial_dir_temp_pointer_and_unpublished_round_are_ignored(tmp_path):
    save_checkpoint(tmp_path, _ckpt(1, seed=1))
    (tmp_path / ".round-000002.partial").mkdir()
    (tmp_path / ".round-000002.partial" / "global.safetensors").write_bytes(b"\x05garbage")
    (tmp_path / ".LATEST.tmp-4242").write_bytes(b"round-0000")
    (tmp_path / "round-000002").mkdir()  # renamed but never published by LATEST
    assert load_checkpoint(tmp_path).round_id == 1


def test_truncated_tensor_file_gives_a_clear_error_naming_it(tmp_path):
    save_checkpoint(tmp_path, _ckpt(1, seed=1))
    save_checkpoint(tmp_path, _ckpt(2, seed=2))
    path = tmp_path / "round-000002" / "global.safetensors"
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert str(path) in message and "truncated" in message and "'round-000001'" in message


@pytest.mark.parametrize("damage", ["state_not_json", "state_wrong_round", "header_bad_dtype", "header_huge",
                                    "missing_strategy", "pointer_escape", "nan_weights", "empty_file"])
def test_damaged_checkpoints_are_refused_with_the_file_named(tmp_path, damage):
    save_checkpoint(tmp_path, _ckpt(3, seed=3))
    d = tmp_path / "round-000003"
    expected = str(d)
    if damage == "state_not_json":
        (d / "state.json").write_bytes(b'{"round": 3, "sampl')
        expected = str(d / "state.json")
    elif damage == "state_wrong_round":
        state = json.loads((d / "state.json").read_text())
        (d / "state.json").write_text(json.dumps({**state, "round": 9}))
    elif damage in ("header_bad_dtype", "header_huge", "nan_weights"):
        names, arrays = ["w"], [np.ones((2, 2), np.float32)]
        if damage == "nan_weights":
            arrays[0][0, 0] = np.nan
        ck.save_tensors(d / "global.safetensors", names, arrays, {"round": "3"})
        raw = (d / "global.safetensors").read_bytes()
        if damage == "header_bad_dtype":
            raw = raw.replace(b'"F32"', b'"O64"')
        elif damage == "header_huge":
            raw = raw.replace(b"[2,2]", b"[9,9]")
        (d / "global.safetensors").write_bytes(raw)
        expected = str(d / "global.safetensors")
    elif damage == "missing_strategy":
        (d / "strategy.safetensors").unlink()
        expected = str(d / "strategy.safetensors")
    elif damage == "pointer_escape":
        (tmp_path / "LATEST").write_text("../../etc")
        expected = "LATEST"
    elif damage == "empty_file":
        (d / "global.safetensors").write_bytes(b"")
        expected = str(d / "global.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    assert expected in str(err.value), str(err.value)


def test_only_the_newest_checkpoints_are_kept_and_the_live_one_is_never_overwritten(tmp_path):
    for r in range(1, 5):
        save_checkpoint(tmp_path, _ckpt(r, seed=r))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "round-000003", "round-000004"]
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        save_checkpoint(tmp_path, _ckpt(4, seed=9))
    assert _same(load_checkpoint(tmp_path), _ckpt(4, seed=4))


def test_restored_example_caps_hold_no_session_and_cap_the_agents_that_join_again():
    registry = AgentRegistry(liveness_timeout=10)
    registry.restore({"a": 5, "b": 6})
    assert registry.live_ids() == [] and len(registry) == 0  # no sessions, nothing live: agents join again
    for token in ("", "anything"):
        with pytest.raises(AuthError, match="call Join first"):
            registry.authenticate("a", token)
    record = registry.join("a", 50, {})  # the count declared first in the run still caps it
    assert record.num_examples == 5 and registry.authenticate("a", record.token) is record
    assert registry.live_ids() == ["a"] and registry.snapshot() == {"b": 6, "a": 5}
    older = AgentRegistry(10)  # a checkpoint from before caps were kept: its list of agents
    older.restore([{"agent_id": "a", "num_examples": 5, "capabilities": {"x": "y"}}])
    assert older.join("a", 9, {}).num_examples == 5
    for bad in ([{"num_examples": 1}], {"a": 0}, {"a": "5"}, {"": 3}, ["a"]):
        with pytest.raises(ValueError, match="bad agent entry|bad example cap"):
            AgentRegistry(10).restore(bad)
