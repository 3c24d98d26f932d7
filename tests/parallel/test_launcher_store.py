"""Spawned ranks meet at a rendezvous store their launcher holds: real processes and a real gloo group."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from fedpar.parallel.init import init_distributed, shutdown_distributed, spawn


def _sum_ranks(out_dir: str) -> None:
    """Join the group, all-reduce this rank's number, and write what it saw."""
    info = init_distributed(60, "cpu")
    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)
    Path(out_dir, f"rank{info.rank}.json").write_text(json.dumps(
        {"sum": total.item(), "port": int(os.environ["MASTER_PORT"]),
         "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}))
    shutdown_distributed()


def test_ranks_meet_at_the_launchers_store_so_no_other_process_can_take_its_port(tmp_path):
    spawn(2, _sum_ranks, str(tmp_path), parent_stops=True)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["sum"] for s in seen] == [3.0, 3.0]
    assert [s["agent_store"] for s in seen] == ["True", "True"]  # rank 0 bound nothing: the launcher did
    assert seen[0]["port"] == seen[1]["port"]
    with socket.socket() as probe:  # the launcher's store is gone with the launch: nothing listens on its port
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (its closed connections may linger)
        probe.bind(("127.0.0.1", seen[0]["port"]))
