"""Coordinator benchmarks: weight-transfer throughput, round overhead, and `fedpar simulate` vs its floor.

One command: ``.venv/bin/python benchmarks/round_bench.py`` (``--quick`` for a smoke run, ``--only
transfer|overhead|simulate`` for one section). Everything runs on 127.0.0.1 and prints one table per section.

1. Transfer: a 100 MB model (25M float32) between the coordinator (this process) and one agent in its own
   process, through fedpar's real client code: the gRPC streams (download_weights into arrays;
   upload_messages) and the bulk data plane (client/dataplane.py: recv_into the arrays; sendall). Next to it,
   in the same run and interleaved with it, raw loopback TCP between the same two processes (Python
   sockets, sendall / recv_into of the same number of bytes). The upload time runs until the coordinator's
   reply, so it includes validation (NaN/Inf scan) and the FedAvg fold. Best and median of --repeats.
2. Round overhead: seconds per round when local training takes no time at all, for N in {10, 100} agents
   and models of 1M, 10M and 100M parameters. The agents (bench_agents.py) download every weight, upload a
   full update and speak the real protocol over whatever the coordinator offers by default (the data plane
   for models >= 8 MiB, the gRPC streams below; --no-data-plane: streams only); they run as threads in 2
   processes. Next to it: the time
   raw TCP would need to move the same bytes (2 x N x model bytes) at the rate measured in section 1.
3. Simulation: `fedpar simulate` (real coordinator, real agents in worker processes, real gRPC) against
   the same FedAvg job as plain PyTorch in one process (fedavg_floor.py: same split, model, epochs, seeds),
   both as fresh processes: total wall time and steady-state seconds per round (median of rounds 2..R).
   The final accuracies are printed too: equal accuracy shows it is the same job.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TRANSFER_PATHS = (("raw loopback TCP (python sockets)", "tcp"),
                  ("gRPC download (DownloadWeights stream)", "download"),
                  ("gRPC upload (incl. NaN check + FedAvg fold)", "upload"),
                  ("data plane download (recv_into arrays)", "dp_download"),
                  ("data plane upload (incl. NaN check + fold)", "dp_upload"))
sys.path.insert(0, str(HERE))

from bench_agents import run_light_worker  # noqa: E402
from results import write_results  # noqa: E402

from fedpar.aggregation import build_strategy  # noqa: E402
from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.client import dataplane  # noqa: E402
from fedpar.client.transfer import download_weights, upload_messages, upload_update  # noqa: E402
from fedpar.protocol import fedpar_pb2 as pb  # noqa: E402
from fedpar.protocol.codec import CoordinatorStub, ModelLayout, channel_options  # noqa: E402
from fedpar.server.app import CoordinatorServer  # noqa: E402
from fedpar.server.config import CoordinatorConfig  # noqa: E402
from fedpar.server.coordinator import Coordinator  # noqa: E402

MIB = 1 << 20


# ----------------------------------------------------------------------------- helpers
def start_coordinator(arrays: list[np.ndarray], rounds: int, agents: int, chunk_bytes: int,
                      data_plane: bool | None = None) -> CoordinatorServer:
    """A coordinator on a free loopback port that runs ``rounds`` rounds with all ``agents`` every round."""
    cfg = CoordinatorConfig(rounds=rounds, clients_per_round=agents, min_available=agents, overselect=1.0,
                            deadline_seconds=3600, heartbeat_seconds=5.0, liveness_timeout_seconds=3600,
                            max_chunk_bytes=chunk_bytes, wait_for_agents_seconds=600, data_plane=data_plane)
    names = [f"layer{i}" for i in range(len(arrays))]
    server = CoordinatorServer(Coordinator(cfg, names, arrays, build_strategy("fedavg")))
    server.start()
    return server


def model_arrays(params: int, seed: int = 0) -> list[np.ndarray]:
    """A model of ``params`` float32 values as a few large matrices and a bias (like real layers)."""
    rng = np.random.default_rng(seed)
    sizes = [params * 6 // 10, params * 3 // 10]
    sizes.append(params - sum(sizes))
    return [rng.standard_normal(n, dtype=np.float32) for n in sizes]


def gbps(nbytes: float, seconds: float) -> float:
    """GB/s (1e9 bytes)."""
    return nbytes / seconds / 1e9


# ----------------------------------------------------------------------------- 1. transfer
def transfer_peer(address: str, specs, chunk_bytes: int, conn) -> None:
    """Agent process for section 1: answers ('tcp', port, n), ('grpc',) and ('dp',) commands with timings."""
    layout = ModelLayout(specs)
    channel = __import__("grpc").insecure_channel(address, options=channel_options(64 * MIB))
    stub = CoordinatorStub(channel)
    reply = stub.Join(pb.JoinRequest(agent_id="transfer-peer", num_examples=1), timeout=30)
    auth = pb.AgentAuth(agent_id="transfer-peer", token=reply.token)
    buf = bytearray(4 * MIB)
    while True:
        cmd = conn.recv()
        if cmd[0] == "tcp":
            _, port, nbytes = cmd
            with socket.create_connection(("127.0.0.1", port)) as s:
                view, got = memoryview(buf), 0
                t0 = time.perf_counter()
                s.sendall(b"g")
                while got < nbytes:
                    n = s.recv_into(view)
                    if not n:
                        raise RuntimeError("raw TCP sender went away")
                    got += n
                conn.send(time.perf_counter() - t0)
        elif cmd[0] in ("grpc", "dp"):
            while True:
                pulled = stub.PullTask(pb.PullTaskRequest(auth=auth, wait_seconds=5.0), timeout=60)
                if pulled.WhichOneof("kind") == "task":
                    break
            task = pulled.task
            if cmd[0] == "dp":
                target = dataplane.DataPlaneTarget(address, task)
                t0 = time.perf_counter()
                arrays = dataplane.download(target, layout, 600)
                t1 = time.perf_counter()
                dataplane.upload(target, auth, task, layout, arrays, 1, 1, {}, 600)
            else:
                t0 = time.perf_counter()
                arrays = download_weights(stub, auth, task, layout, chunk_bytes, timeout=600)
                t1 = time.perf_counter()
                upload_update(stub, upload_messages(auth, task, layout, arrays, 1, 1, {}, chunk_bytes), timeout=600)
            conn.send((t1 - t0, time.perf_counter() - t1))
        else:
            channel.close()
            return


def raw_tcp_once(conn, nbytes: int) -> float:
    """Seconds for the peer process to receive ``nbytes`` sent with sendall in 1 MiB writes."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        conn.send(("tcp", listener.getsockname()[1], nbytes))
        peer, _ = listener.accept()
        with peer:
            peer.recv(1)
            block = memoryview(bytes(MIB))
            left = nbytes
            while left:
                take = min(left, MIB)
                peer.sendall(block[:take])
                left -= take
            seconds = conn.recv()
    return seconds


def bench_transfer(params: int, repeats: int, chunk_bytes: int) -> dict:
    """Interleaved raw TCP / gRPC / data-plane download and upload timings for one model size."""
    arrays = model_arrays(params)
    nbytes = sum(a.nbytes for a in arrays)
    server = start_coordinator(arrays, rounds=2 * (repeats + 1), agents=1, chunk_bytes=chunk_bytes,
                               data_plane=True)
    specs = ModelLayout.of_arrays([f"layer{i}" for i in range(len(arrays))], arrays).specs()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=transfer_peer, args=(server.address, specs, chunk_bytes, child), daemon=True)
    peer.start()
    tcp, down, up, dp_down, dp_up = [], [], [], [], []
    try:
        for rep in range(repeats + 1):
            t = raw_tcp_once(parent, nbytes)
            parent.send(("grpc",))
            d, u = parent.recv()
            parent.send(("dp",))
            dd, du = parent.recv()
            if rep:  # the first repeat touches fresh memory on both sides: warm-up
                tcp.append(t), down.append(d), up.append(u), dp_down.append(dd), dp_up.append(du)
        parent.send(("stop",))
        peer.join(30)
        server.wait(60)
    finally:
        if peer.is_alive():
            peer.terminate()
        server.stop()
    return {"bytes": nbytes, "tcp": tcp, "download": down, "upload": up, "dp_download": dp_down, "dp_upload": dp_up}


def print_transfer(result: dict, chunk_bytes: int) -> float:
    """Print section 1; returns the best raw TCP rate (GB/s) for section 2."""
    n = result["bytes"]
    best_tcp = gbps(n, min(result["tcp"]))
    print(f"\n== 1. Weight transfer: {n / 1e6:.0f} MB model, coordinator <-> 1 agent process, "
          f"{chunk_bytes // 1024} KiB chunks, {len(result['tcp'])} interleaved repeats ==")
    print(f"{'path':<44}{'best GB/s':>10}{'median GB/s':>13}{'best / raw TCP':>16}")
    for label, key in TRANSFER_PATHS:
        best = gbps(n, min(result[key]))
        median = gbps(n, statistics.median(result[key]))
        print(f"{label:<44}{best:>10.3f}{median:>13.3f}{best / best_tcp:>16.2f}")
    return best_tcp


def transfer_ratios(result: dict) -> list[dict]:
    """Section 1 as envelope ratios: each path's best rate over the best raw TCP rate of the same run."""
    best_tcp = min(result["tcp"])
    return [{"what": f"{result['bytes'] / 1e6:.0f} MB model, {label}", "ratio": best_tcp / min(result[key]),
             "against": "raw loopback TCP, same run (rate ratio)"} for label, key in TRANSFER_PATHS[1:]]


# ----------------------------------------------------------------------------- 2. round overhead
def bench_overhead(params: int, agents: int, rounds: int, chunk_bytes: int, workers: int = 2,
                   data_plane: bool | None = None) -> dict:
    """Steady-state round seconds with ``agents`` non-training agents and a ``params``-parameter model."""
    arrays = model_arrays(params)
    server = start_coordinator(arrays, rounds=rounds, agents=agents, chunk_bytes=chunk_bytes, data_plane=data_plane)
    rows: list[dict] = []  # the coordinator keeps its rows on disk only; these few are collected as they end
    server.coordinator.on_round_end.append(rows.append)
    specs = ModelLayout.of_arrays([f"layer{i}" for i in range(len(arrays))], arrays).specs()
    ids = [f"bench-{i:04d}" for i in range(agents)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_light_worker, args=(server.address, specs, ids[w::workers], chunk_bytes, w),
                         daemon=True) for w in range(workers)]
    for p in procs:
        p.start()
    try:
        while not server.wait(1.0):
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a benchmark agent process failed; see its traceback above")
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        server.stop()
    if any(r["status"] != "ok" or r["reported"] != agents for r in rows):
        raise RuntimeError(f"a benchmark round did not complete with all agents: {rows}")
    return {"bytes": sum(a.nbytes for a in arrays), "round_seconds": [r["round_seconds"] for r in rows],
            "path": "data plane" if server.coordinator.data_port else "gRPC"}


def print_overhead(results: list[tuple[int, int, dict]], tcp_gbps: float) -> None:
    """Print section 2."""
    print("\n== 2. Round overhead: seconds per round beyond local training (agents train for 0 s) ==")
    print(f"{'agents':>6}{'params':>8}{'model MB':>10}{'rounds':>8}{'s/round':>10}{'raw-TCP s':>11}"
          f"{'ratio':>8}{'first round s':>15}{'path':>12}")
    for agents, params, r in results:
        steady = r["round_seconds"][1:] or r["round_seconds"]
        per_round = statistics.median(steady)
        wire = 2 * agents * r["bytes"] / (tcp_gbps * 1e9)
        print(f"{agents:>6}{params / 1e6:>7.0f}M{r['bytes'] / 1e6:>10.0f}{len(steady):>8}{per_round:>10.3f}"
              f"{wire:>11.3f}{per_round / wire:>8.2f}{r['round_seconds'][0]:>15.3f}{r['path']:>12}")
    print("raw-TCP s: time to move every round's bytes (N downloads + N uploads) at section 1's raw TCP rate; "
          "s/round: median of rounds 2..R")


def overhead_ratios(results: list[tuple[int, int, dict]], tcp_gbps: float) -> list[dict]:
    """Section 2 as envelope ratios: steady seconds per round over raw TCP's time for the same bytes."""
    return [{"what": f"round, {agents} agents x {params / 1e6:.0f}M parameters ({r['path']})",
             "ratio": statistics.median(r["round_seconds"][1:] or r["round_seconds"])
             / (2 * agents * r["bytes"] / (tcp_gbps * 1e9)),
             "against": "raw loopback TCP moving the round's bytes at section 1's rate"}
            for agents, params, r in results]


# ----------------------------------------------------------------------------- 3. simulate vs floor
def run_timed(cmd: list[str]) -> tuple[float, str]:
    """Wall seconds of a fresh process running ``cmd``, and its stdout."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def bench_simulate(job: dict, out_root: Path) -> dict:
    """`fedpar simulate` and the plain-PyTorch floor on the same job, each as a fresh process."""
    flags = [f"--clients={job['clients']}", f"--rounds={job['rounds']}", f"--dataset={job['dataset']}",
             f"--local-epochs={job['epochs']}", f"--batch-size={job['batch']}", f"--lr={job['lr']}"]
    if job.get("data_dir"):
        flags.append(f"--data-dir={job['data_dir']}")
    if job.get("per_round"):
        flags.append(f"--clients-per-round={job['per_round']}")
    out = out_root / f"{job['dataset']}-{job['clients']}"
    fedpar = str(Path(sys.executable).with_name("fedpar"))
    sim_wall, _ = run_timed([fedpar, "simulate", *flags, f"--out={out}", "--quiet"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    floor_wall, floor_out = run_timed([sys.executable, str(HERE / "fedavg_floor.py"), *flags])
    floor = json.loads(floor_out)
    return {"sim_wall": sim_wall, "sim_rounds": [r["round_seconds"] for r in rows],
            "sim_acc": rows[-1]["test_accuracy"], "floor_wall": floor_wall,
            "floor_rounds": [r["round_seconds"] for r in floor["rounds"]], "floor_acc": floor["final_test_accuracy"]}


def print_simulate(results: list[tuple[dict, dict]]) -> None:
    """Print section 3."""
    print("\n== 3. fedpar simulate vs the same FedAvg job in plain PyTorch (one process) ==")
    print(f"{'job':<44}{'wall s':>8}{'floor':>8}{'ratio':>7}{'s/round':>9}{'floor':>8}{'ratio':>7}"
          f"{'accuracy':>10}{'floor':>8}")
    for job, r in results:
        cohort = f"{job['per_round']} of {job['clients']}" if job.get("per_round") else f"{job['clients']}"
        name = f"{job['dataset']} {cohort} clients x {job['rounds']} rounds E={job['epochs']} B={job['batch']}"
        sim_round = statistics.median(r["sim_rounds"][1:])
        floor_round = statistics.median(r["floor_rounds"][1:])
        print(f"{name:<44}{r['sim_wall']:>8.2f}{r['floor_wall']:>8.2f}{r['sim_wall'] / r['floor_wall']:>7.2f}"
              f"{sim_round:>9.3f}{floor_round:>8.3f}{sim_round / floor_round:>7.2f}"
              f"{r['sim_acc']:>10.4f}{r['floor_acc']:>8.4f}")
    print("wall: whole process, start-up included; s/round: median of rounds 2..R; ratio = fedpar / floor "
          "(target <= 1.5)")


def simulate_ratios(results: list[tuple[dict, dict]]) -> list[dict]:
    """Section 3 as envelope ratios: fedpar simulate's wall time and steady s/round over the floor's."""
    ratios = []
    for job, r in results:
        cohort = f"{job['per_round']} of {job['clients']}" if job.get("per_round") else f"{job['clients']}"
        name = f"fedpar simulate, {job['dataset']} {cohort} clients x {job['rounds']} rounds"
        against = "the same FedAvg job in plain PyTorch (fedavg_floor.py), same run"
        ratios += [{"what": f"{name}, wall", "ratio": r["sim_wall"] / r["floor_wall"], "against": against},
                   {"what": f"{name}, s/round", "ratio": statistics.median(r["sim_rounds"][1:])
                    / statistics.median(r["floor_rounds"][1:]), "against": against}]
    return ratios


# ----------------------------------------------------------------------------- main
def main() -> None:
    """Run the chosen sections and print their tables."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes only: a smoke run of every section")
    p.add_argument("--only", choices=["transfer", "overhead", "simulate"], help="run one section")
    p.add_argument("--repeats", type=int, default=5, help="transfer repeats (after one warm-up)")
    p.add_argument("--no-data-plane", action="store_true",
                   help="section 2: weights over the gRPC streams only (the coordinator's default is the data "
                        "plane for models >= 8 MiB)")
    p.add_argument("--chunk-kib", type=int, default=1024, help="chunk size on the wire")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/round_bench.json"),
                   help="where to write the ratios and raw figures")
    p.add_argument("--mnist-dir", default=str(HERE.parent.parent / "shared" / "data" / "mnist"),
                   help="MNIST folder for the MNIST simulation jobs (skipped if missing)")
    a = p.parse_args()
    chunk = a.chunk_kib * 1024
    print(f"fedpar round benchmark on {os.cpu_count()} cores; chunk {a.chunk_kib} KiB")
    tcp_gbps = None
    ratios, raw = [], {}
    if a.only in (None, "transfer", "overhead"):
        result = bench_transfer(4_000_000 if a.quick else 25_000_000, 2 if a.quick else a.repeats, chunk)
        tcp_gbps = print_transfer(result, chunk)
        ratios += transfer_ratios(result)
        raw["transfer"] = result
    if a.only in (None, "overhead"):
        cells = [(10, 1_000_000, 4), (10, 10_000_000, 3), (100, 1_000_000, 4)]
        if not a.quick:
            cells += [(100, 10_000_000, 3), (10, 100_000_000, 3), (100, 100_000_000, 2)]
        results = []
        for agents, params, rounds in cells:
            results.append((agents, params, bench_overhead(params, agents, rounds, chunk,
                                                           data_plane=False if a.no_data_plane else None)))
            print(f"  overhead: {agents} agents x {params / 1e6:.0f}M done", flush=True)
        print_overhead(results, tcp_gbps)
        ratios += overhead_ratios(results, tcp_gbps)
        raw["overhead"] = [{"agents": agents, "params": params, **r} for agents, params, r in results]
    if a.only in (None, "simulate"):
        jobs = [dict(dataset="digits", clients=10, rounds=10, epochs=5, batch=16, lr=0.1),
                dict(dataset="digits", clients=100, rounds=10, epochs=5, batch=16, lr=0.1)]
        if not a.quick and (Path(a.mnist_dir) / "README.md").exists():
            jobs += [dict(dataset="mnist", data_dir=a.mnist_dir, clients=10, rounds=5, epochs=1, batch=32, lr=0.05),
                     dict(dataset="mnist", data_dir=a.mnist_dir, clients=100, rounds=5, epochs=1, batch=32, lr=0.05),
                     # the FedAvg paper's MNIST setting (C=0.1, E=5, B=10), with the MLP
                     dict(dataset="mnist", data_dir=a.mnist_dir, clients=100, per_round=10, rounds=10, epochs=5,
                          batch=10, lr=0.05)]
        if a.quick:
            jobs = [dict(jobs[0], rounds=4)]
        results = []
        with tempfile.TemporaryDirectory() as tmp:
            for job in jobs:
                results.append((job, bench_simulate(job, Path(tmp))))
                print(f"  simulate: {job['dataset']} {job['clients']} clients done", flush=True)
        print_simulate(results)
        ratios += simulate_ratios(results)
        raw["simulate"] = [{"job": job, **r} for job, r in results]
    print(f"wrote {write_results(a.json, ratios, raw)}")


if __name__ == "__main__":
    main()
