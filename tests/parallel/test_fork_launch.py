"""Ranks forked from their launcher (serve's aggregator ranks on a machine without a GPU): real processes."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch

from fedpar.parallel.init import fork_safe, spawn


def _note_rank(out_dir: str, parent: int) -> None:
    """Write what this rank sees: its RANK, its parent, and whether torch came with the copy (not imported again)."""
    Path(out_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps(
        {"world": int(os.environ["WORLD_SIZE"]), "parent": os.getppid(), "launcher": parent,
         "threads": torch.get_num_threads()}))


def test_forked_ranks_run_the_function_as_children_of_the_launcher(tmp_path):
    spawn(2, _note_rank, str(tmp_path), os.getpid(), parent_stops=True, start_method="fork")
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["world"] for s in seen] == [2, 2]
    assert all(s["parent"] == s["launcher"] == os.getpid() for s in seen)
    assert all(s["threads"] == 1 for s in seen)  # one intra-op thread each, as spawned ranks


def test_forking_is_unsafe_while_another_thread_runs():
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not fork_safe()
    finally:
        stop.set()
        other.join()
