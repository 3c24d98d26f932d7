"""A real coordinator serving a synthetic numpy model (no dataset): the subject of load tests and benchmarks (run as
a script: ``python tests/support/synthetic_coordinator.py --help``).

It writes its bound port to --port-file and, with --memory-file, one JSON line of its own memory
(VmRSS/VmHWM from /proc/self/status, in KiB) when it starts listening and after every round.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from fedpar.aggregation import build_strategy
from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.server.assembly import CoordinatorAssembly, synthetic_model
from fedpar.server.config import CoordinatorConfig


def memory_kib() -> dict[str, int]:
    """VmRSS and VmHWM of this process in KiB (Linux)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def main(argv: list[str] | None = None) -> int:
    """Serve the synthetic model until every round is done."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", type=int, default=10_000, help="model size in float32 parameters")
    p.add_argument("--rounds", type=int, default=2, help="rounds to run")
    p.add_argument("--agents", type=int, required=True,
                   help="min_available (agents, or members of populations); also K unless --clients-per-round")
    p.add_argument("--clients-per-round", type=int, help="K (default: --agents)")
    p.add_argument("--deadline", type=float, default=60.0, help="round deadline in seconds")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one)")
    p.add_argument("--port-file", type=Path, required=True, help="the bound port is written here")
    p.add_argument("--checkpoint-dir", type=Path, help="checkpoint every round and resume from here")
    p.add_argument("--metrics", type=Path, help="metrics.jsonl path")
    p.add_argument("--memory-file", type=Path, help="append this process's memory as JSON lines here")
    p.add_argument("--linger", type=float, default=3.0,
                   help="at most this many seconds to keep serving 'shutdown' after the last round, "
                   "until every live agent has heard it")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    names, weights = synthetic_model(args.params)
    k = args.clients_per_round or args.agents
    config = CoordinatorConfig(rounds=args.rounds, clients_per_round=k, min_available=args.agents, overselect=1.0,
                               deadline_seconds=args.deadline, liveness_timeout_seconds=60.0,
                               checkpoint_dir=args.checkpoint_dir, metrics_path=args.metrics,
                               max_concurrent_rpcs=max(20_000, 4 * args.agents), accept_populations=True)

    def note(row: dict | None) -> None:
        if args.memory_file:
            with args.memory_file.open("a") as fh:
                cpu = os.times()
                fh.write(json.dumps({"round": row["round"] if row else 0, "time": time.time(),
                                     "cpu_seconds": cpu.user + cpu.system, **memory_kib()}) + "\n")

    server = CoordinatorAssembly(names, weights).server(config, build_strategy("fedavg"), on_round_end=[note],
                                                        port=args.port)
    server.start()
    note(None)
    atomic_write_bytes(args.port_file, [f"{server.port}\n".encode()])
    try:
        server.wait()
        linger_until = time.monotonic() + args.linger
        while not server.coordinator.everyone_told_finished() and time.monotonic() < linger_until:
            time.sleep(0.05)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
