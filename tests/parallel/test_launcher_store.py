"""Spawned ranks meet at a rendezvous store their launcher holds: real processes and a real gloo group."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from fedpar.parallel.init import LAUNCHER_STORE_ENV, init_distributed, shutdown_distributed, spawn


def _sum_ranks(out_dir: str) -> None:
    """Join the group, all-reduce this rank's number, and write what it saw."""
    with socket.socket() as probe:  # before joining: does anything listen on the rendezvous port (the launcher)?
        taken = probe.connect_ex(("127.0.0.1", int(os.environ["MASTER_PORT"]))) == 0
    info = init_distributed(60, "cpu")
    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)
    Path(out_dir, f"rank{info.rank}.json").write_text(json.dumps(
        {"sum": total.item(), "port": int(os.environ["MASTER_PORT"]), "listening_before_join": taken,
         "store_note_left": os.environ.get(LAUNCHER_STORE_ENV)}))
    shutdown_distributed()


def test_ranks_meet_at_the_launchers_store_so_no_other_process_can_take_its_port(tmp_path):
    spawn(2, _sum_ranks, str(tmp_path), parent_stops=True)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["sum"] for s in seen] == [3.0, 3.0]
    assert all(s["listening_before_join"] for s in seen)  # the launcher bound the port, not rank 0
    assert [s["store_note_left"] for s in seen] == [None, None]  # read once: no later group or child sees it
    assert seen[0]["port"] == seen[1]["port"]
    with socket.socket() as probe:  # the launcher's store is gone with the launch: nothing listens on its port
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (its closed connections may linger)
        probe.bind(("127.0.0.1", seen[0]["port"]))
