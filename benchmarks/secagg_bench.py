"""Secure-aggregation overhead over real gRPC: SecAgg+ rounds next to plain FedAvg rounds, same run.

One command: ``.venv/bin/python benchmarks/secagg_bench.py`` (``--quick`` for a smoke run).

For each cohort size N (default 10 and 50) and a model of P float32 parameters (default 1M, one
1000 x 1000 tensor), it starts a real coordinator on 127.0.0.1 and N scripted agents (threads in
--workers spawned processes, as `fedpar simulate` does) and runs --rounds rounds of plain FedAvg, then
--rounds rounds with --secure-aggregation. Agents do not train: each adds a fixed random delta to the
global weights, so the rounds measure aggregation and transport only. Reported per round (median over
the rounds after the first, which pays channel and page-fault warm-up; the median resists the load
other processes put on this shared machine):
- total s: the coordinator's round_seconds (task dispatch -> new global model);
- client CPU s: per agent, median CPU seconds (thread time) of its local secure-aggregation work:
  computing local - global, key generation, Shamir splitting and share encryption, quantizing and
  adding the masks, and the unmask answer (no network waits);
- unmask s / unmask CPU s: wall and CPU seconds of the coordinator's mask removal (Shamir
  reconstruction, PRG expansion, dequantization);
- overhead s: secure total minus plain total; time x / bytes x: secure over plain;
- MB up: tensor bytes of the cohort's uploads as the coordinator counted them (its upload_bytes metric);
  MB down: the cohort's N downloads of the model; ctrl KB: the SecAggExchange messages (keys, encrypted
  shares, survivor lists, unmask shares) of the whole cohort, as serialized.
The machine is shared and small (2 cores for the coordinator and every agent), so the seconds are
upper bounds for a real deployment where each agent has its own machine.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from fedpar.aggregation import build_strategy
from fedpar.cli.argtypes import FedparParser
from fedpar.client.secure_upload import SecureSession, flat_update
from fedpar.client.transfer import download_weights, upload_messages, upload_update
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CoordinatorStub, ModelLayout, channel_options
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator
from results import write_results  # benchmarks/, this script's folder

CHUNK = 1 << 20
EXAMPLES = 100


def _shape(params: int) -> tuple[int, ...]:
    side = int(round(params ** 0.5))
    return (side, side) if side * side == params else (params,)


def _agent(address: str, agent_id: str, shape: tuple[int, ...], seed: int, records: list) -> None:
    """Join, then answer every task with global + a fixed delta, masked when the round is secure."""
    channel = grpc.insecure_channel(address, options=channel_options(64 << 20))
    stub = CoordinatorStub(channel)
    reply = stub.Join(pb.JoinRequest(agent_id=agent_id, num_examples=EXAMPLES), timeout=60)
    auth = pb.AgentAuth(agent_id=agent_id, token=reply.token)
    layout = ModelLayout([("w", "float32", shape)])
    delta = np.random.default_rng(seed).uniform(-0.01, 0.01, shape).astype(np.float32)
    try:
        while True:
            pulled = stub.PullTask(pb.PullTaskRequest(auth=auth, wait_seconds=5.0), timeout=60)
            kind = pulled.WhichOneof("kind")
            if kind == "shutdown_reason":
                return
            if kind != "task":
                continue
            task = pulled.task
            secure = "secure_aggregation" in (task.extra_json or "")
            session = SecureSession(stub, auth, task, poll_seconds=5.0, stage_timeout=600.0) if secure else None
            if session:
                session.begin(int(np.prod(shape)))
            weights = download_weights(stub, auth, task, layout, CHUNK, timeout=600)
            local = [weights[0] + delta]
            if session:
                start = time.thread_time()
                update = flat_update(local, weights)
                session.compute_cpu_seconds += time.thread_time() - start
                session.upload_masked(update, EXAMPLES, {}, CHUNK, timeout=600)
                session.unmask()
                records.append((task.round, session.compute_cpu_seconds, session.bytes_received + session.bytes_sent
                                - update.size * 4 - 4))
            else:
                upload_update(stub, upload_messages(auth, task, layout, local, EXAMPLES, 1, {}, CHUNK), timeout=600)
                records.append((task.round, 0.0, 0))
    finally:
        channel.close()


def _worker(address: str, ids: list[str], shape: tuple[int, ...], out: mp.Queue) -> None:
    records: list = []
    threads = [threading.Thread(target=_agent, args=(address, i, shape, k, records)) for k, i in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(records)


def run_mode(n: int, params: int, rounds: int, workers: int, secure: bool) -> dict:
    """Run ``rounds`` rounds with ``n`` agents; per-round medians after the first round."""
    shape = _shape(params)
    config = CoordinatorConfig(rounds=rounds, clients_per_round=n, min_available=n, overselect=1.0,
                               deadline_seconds=900.0, heartbeat_seconds=5.0, liveness_timeout_seconds=120.0,
                               wait_for_agents_seconds=300.0, max_chunk_bytes=CHUNK, secure_aggregation=secure,
                               secagg_stage_seconds=600.0)
    init = [np.random.default_rng(0).standard_normal(shape).astype(np.float32)]
    coordinator = Coordinator(config, ["w"], init, build_strategy("fedavg"))
    rows: list[dict] = []  # the coordinator keeps its rows on disk only; these few are collected as they end
    coordinator.on_round_end.append(rows.append)
    server = CoordinatorServer(coordinator)
    server.start()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ids = [f"agent-{i:03d}" for i in range(n)]
    procs = [ctx.Process(target=_worker, args=(server.address, ids[w::workers], shape, out), daemon=True)
             for w in range(workers)]
    try:
        for p in procs:
            p.start()
        while not server.wait(1.0):
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("an agent worker died")
        records = []
        for _ in procs:
            records.extend(out.get(timeout=120))
        for p in procs:
            p.join(30)
    except queue.Empty:
        raise RuntimeError("agent workers did not report") from None
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        server.stop()
    if any(r["status"] != "ok" for r in rows):
        raise RuntimeError(f"a round failed: {[r for r in rows if r['status'] != 'ok'][:1]}")
    measured = [r for r in rows if r["round"] > 1] or rows
    kept = {r["round"] for r in measured}
    agent_rows = [a for a in records if a[0] in kept]
    model_bytes = params * 4
    return {
        "total_s": float(np.median([r["round_seconds"] for r in measured])),
        "client_mask_s": float(np.median([a[1] for a in agent_rows])) if secure else 0.0,
        "unmask_s": float(np.median([r.get("secagg_unmask_seconds", 0.0) for r in measured])),
        "unmask_cpu_s": float(np.median([r.get("secagg_unmask_cpu_seconds", 0.0) for r in measured])),
        "mb_up": float(np.median([r["upload_bytes"] for r in measured])) / 1e6,  # accepted at the coordinator
        "mb_down": n * model_bytes / 1e6,
        "ctrl_kb": sum(a[2] for a in agent_rows) / len(kept) / 1e3,
        "rounds": len(measured),
        "timeline": [float(np.median([r.get(f"secagg_{k}_at", 0.0) for r in measured]))
                     for k in ("shared", "masked", "unmask_shares")],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, nargs="+", default=[10, 50], help="cohort sizes to measure")
    p.add_argument("--params", type=int, default=1_000_000, help="float32 parameters of the model")
    p.add_argument("--rounds", type=int, default=4, help="rounds per mode (the first is warm-up)")
    p.add_argument("--workers", type=int, default=2, help="agent processes (agents are threads in them)")
    p.add_argument("--quick", action="store_true", help="smoke run: 5 agents, 10k parameters, 2 rounds")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/secagg_bench.json"),
                   help="where to write the ratios and raw figures")
    args = p.parse_args(argv)
    if args.quick:
        args.agents, args.params, args.rounds = [5], 10_000, 2
    logging.basicConfig(level=logging.WARNING)
    print(f"secure aggregation vs plain FedAvg over gRPC on 127.0.0.1: {args.params:,} float32 parameters, "
          f"{args.rounds} rounds per mode (median of rounds 2..{args.rounds}), {args.workers} agent processes, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    header = (f"{'agents':>6} {'mode':>7} {'total s':>8} {'overhead s':>10} {'client CPU s':>12} {'unmask s':>9} "
              f"{'unmask CPU s':>12} {'MB up':>7} {'MB down':>7} {'ctrl KB':>8} {'time x':>7} {'bytes x':>8}")
    print(header)
    print("-" * len(header), flush=True)
    timelines, ratios, raw = [], [], []
    for n in args.agents:
        plain = run_mode(n, args.params, args.rounds, args.workers, secure=False)
        secure = run_mode(n, args.params, args.rounds, args.workers, secure=True)
        plain_bytes = plain["mb_up"] + plain["mb_down"]
        for name, r in (("plain", plain), ("secagg", secure)):
            bytes_ratio = (r["mb_up"] + r["mb_down"] + r["ctrl_kb"] / 1e3) / plain_bytes
            print(f"{n:>6} {name:>7} {r['total_s']:>8.2f} {r['total_s'] - plain['total_s']:>10.2f} "
                  f"{r['client_mask_s']:>12.3f} {r['unmask_s']:>9.3f} {r['unmask_cpu_s']:>12.3f} "
                  f"{r['mb_up']:>7.1f} {r['mb_down']:>7.1f} {r['ctrl_kb']:>8.1f} "
                  f"{r['total_s'] / plain['total_s']:>7.2f} {bytes_ratio:>8.4f}", flush=True)
        timelines.append((n, secure["timeline"], secure["total_s"]))
        against = f"plain FedAvg, same run ({n} agents, {args.params:,} parameters)"
        ratios += [{"what": f"SecAgg+ round time, {n} agents", "ratio": secure["total_s"] / plain["total_s"],
                    "against": against},
                   {"what": f"SecAgg+ bytes, {n} agents", "against": against,
                    "ratio": (secure["mb_up"] + secure["mb_down"] + secure["ctrl_kb"] / 1e3) / plain_bytes}]
        raw.append({"agents": n, "params": args.params, "plain": plain, "secagg": secure})
    print("\nsecure rounds, seconds from task dispatch until: keys exchanged (stages 1-2) | every masked input "
          "in (download, masking, upload) | unmask shares in | new model")
    for n, (keys_at, masked_at, shares_at), total in timelines:
        print(f"{n:>6} agents: {keys_at:6.2f} | {masked_at:6.2f} | {shares_at:6.2f} | {total:6.2f}")
    print(f"wrote {write_results(args.json, ratios, raw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
