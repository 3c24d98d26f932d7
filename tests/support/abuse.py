"""Honest rounds under attack, on loopback: a real coordinator, real agents (client/agent.py) in threads, and a
stranger in its own process that starts after the undisturbed rounds. Used by the attack tests and by
benchmarks/abuse_bench.py.

The attackers (each one process, one thread, asyncio or one selector):
- :func:`silent_streams`: UploadUpdate streams that never send their header, re-opened as they are let go;
  with a certificate (e.g. a revoked one) when given one.
- :func:`silent_requests`: Join calls that never send their request, re-opened as they are let go.
- :func:`idle_sockets`: TCP connections to the data plane that never send a byte, re-opened as they are closed.
- :func:`trickling_uploads`: sampled agents of the attacker's own that, once the attack starts, answer every task
  with an upload trickling 4 bytes every 0.3 s (each holds a staging slot until its pace gets it refused), and
  upload again while the coordinator lets them.
- :func:`inflated_updates`: sampled agents of the attacker's own that declare the most examples they may and
  answer every task at once with weights of 1000, first claiming a thousand times their examples.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import selectors
import socket
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import SERVICE_NAME, CoordinatorStub, channel_options

REOPEN_PER_SECOND = 200  # how fast an attacker re-opens what was let go (it would burn its own CPU otherwise)


# ----------------------------------------------------------------------------- attackers (child processes)
def silent_streams(address: str, count: int, tls: dict | None, start, stop, out) -> None:
    """Keep ``count`` silent UploadUpdate streams open until ``stop``; put a Counter of how they ended in ``out``."""
    start.wait()
    out.put(asyncio.run(_silent_calls(address, count, tls, stop, "UploadUpdate")))


def silent_requests(address: str, count: int, start, stop, out) -> None:
    """Keep ``count`` Join calls open that never send their request until ``stop``; put a Counter of how they ended
    in ``out``."""
    start.wait()
    out.put(asyncio.run(_silent_calls(address, count, None, stop, "Join")))


async def _silent_calls(address: str, count: int, tls: dict | None, stop, method: str) -> Counter:
    options = channel_options(64 << 20)
    if tls:
        from fedpar.security.tls import TlsFiles, channel_credentials
        files = TlsFiles(*(Path(tls[k]) if tls.get(k) else None for k in ("cert", "key", "ca")))
        channel = grpc.aio.secure_channel(address, channel_credentials(files), options=options)
    else:
        channel = grpc.aio.insecure_channel(address, options=options)
    # A request stream whose first message never comes: for a unary method, a call that never sends its request.
    call = channel.stream_unary(f"/{SERVICE_NAME}/{method}", request_serializer=lambda m: m.SerializeToString())
    ended: Counter = Counter()
    pace = asyncio.Semaphore(count)

    async def never():
        await asyncio.sleep(3600)
        yield pb.UploadChunk()

    async def one() -> None:
        while not stop.is_set():
            async with pace:
                try:
                    await call(never(), timeout=30)
                except grpc.aio.AioRpcError as err:
                    ended[f"{err.code().name}: {(err.details() or '')[:160]}"] += 1
            await asyncio.sleep(count / REOPEN_PER_SECOND)

    tasks = [asyncio.ensure_future(one()) for _ in range(count)]
    while not stop.is_set():
        await asyncio.sleep(0.05)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await channel.close()
    return ended


def idle_sockets(host: str, port: int, count: int, start, stop, out) -> None:
    """Keep ``count`` idle TCP connections to ``host:port`` until ``stop``; put how many were closed in ``out``."""
    start.wait()
    sel = selectors.DefaultSelector()
    opened = closed = 0
    last_open = 0.0
    while not stop.is_set():
        while len(sel.get_map()) < count and time.monotonic() - last_open >= 1 / REOPEN_PER_SECOND:
            try:
                sock = socket.create_connection((host, port), timeout=2)
            except OSError:
                break
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
            opened += 1
            last_open = time.monotonic() if len(sel.get_map()) > count // 2 else 0.0
        for key, _ in sel.select(0.01):
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:  # the coordinator let it go
                sel.unregister(key.fileobj)
                key.fileobj.close()
                closed += 1
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    out.put(Counter(opened=opened, closed=closed))


def trickling_uploads(address: str, ids: list[str], layout_specs, start, stop, out) -> None:
    """Join as ``ids`` at once (so they are sampled) and, after ``start``, trickle every task's upload until
    ``stop``; put a Counter of how the uploads ended in ``out``."""
    from fedpar.client.transfer import upload_header
    from fedpar.protocol.codec import ModelLayout, encode_data_message

    layout = ModelLayout(layout_specs)
    ended: Counter = Counter()
    lock = threading.Lock()

    def trickle(auth, task):
        yield pb.UploadChunk(header=upload_header(auth, task, layout, 1, 1, {}))
        for offset in range(0, layout.total_bytes, 4):
            if stop.is_set():
                return
            time.sleep(0.3)
            yield encode_data_message(offset, b"\0\0\0\0")

    def one(agent_id: str) -> None:
        channel = grpc.insecure_channel(address, options=channel_options(64 << 20))
        stub = CoordinatorStub(channel)
        auth = pb.AgentAuth(agent_id=agent_id, token=stub.Join(pb.JoinRequest(agent_id=agent_id, num_examples=1),
                                                               timeout=30).token)
        while not stop.is_set():
            try:
                reply = stub.PullTask(pb.PullTaskRequest(auth=auth, wait_seconds=1.0), timeout=10)
                if reply.WhichOneof("kind") != "task" or not start.is_set():
                    continue  # before the attack: a silent straggler
                while not stop.is_set():  # upload again as long as the coordinator takes the attempts
                    stub.UploadUpdate(trickle(auth, reply.task), timeout=60)
            except grpc.RpcError as err:
                with lock:
                    ended[f"{err.code().name}: {(err.details() or '')[:100]}"] += 1
                time.sleep(0.1)  # refused (e.g. out of attempts this round): ask again, not in a tight loop
        channel.close()

    threads = [threading.Thread(target=one, args=(a,), daemon=True) for a in ids]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(5)
    out.put(ended)


def inflated_updates(address: str, ids: list[str], layout_specs, examples: int, start, stop, out) -> None:
    """Join as ``ids`` declaring ``examples`` each and, after ``start``, answer every task at once with weights of
    1000 claiming those examples (and a thousand times more first) until ``stop``; put a Counter of how the
    uploads ended in ``out``."""
    from fedpar.client.transfer import upload_messages, upload_update
    from fedpar.protocol.codec import ModelLayout

    layout = ModelLayout(layout_specs)
    arrays = [np.full(shape, 1000.0, np.dtype(dtype)) for _, dtype, shape in layout_specs]
    ended: Counter = Counter()
    lock = threading.Lock()

    def one(agent_id: str) -> None:
        channel = grpc.insecure_channel(address, options=channel_options(64 << 20))
        stub = CoordinatorStub(channel)
        auth = pb.AgentAuth(agent_id=agent_id, token=stub.Join(
            pb.JoinRequest(agent_id=agent_id, num_examples=examples), timeout=30).token)
        while not stop.is_set():
            try:
                reply = stub.PullTask(pb.PullTaskRequest(auth=auth, wait_seconds=1.0), timeout=10)
                if reply.WhichOneof("kind") != "task" or not start.is_set():
                    continue  # before the attack: a silent straggler
                for claim in (examples * 1000, examples):  # the inflated claim is refused; the bound is taken
                    try:
                        upload_update(stub, upload_messages(auth, reply.task, layout, arrays, claim, 1, {}, 1 << 20),
                                      timeout=30)
                        outcome = f"accepted claiming {claim}"
                    except grpc.RpcError as err:
                        outcome = f"{err.code().name}: {(err.details() or '')[:100]}"
                    with lock:
                        ended[outcome] += 1
            except grpc.RpcError as err:
                with lock:
                    ended[f"{err.code().name}: {(err.details() or '')[:100]}"] += 1
                time.sleep(0.1)
        channel.close()

    threads = [threading.Thread(target=one, args=(a,), daemon=True) for a in ids]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(5)
    out.put(ended)


# ----------------------------------------------------------------------------- honest side
def tiny_model(seed: int = 0):
    """A small torch classifier (the global model of these runs)."""
    import torch
    from torch import nn
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def honest_agent(address: str, agent_id: str, train_seconds: float, credentials=None, data_tls=None,
                 seed: int = 0):
    """A real agent (client/agent.py) training ``tiny_model`` on 64 random examples for about ``train_seconds``."""
    from fedpar.client.agent import Agent, AgentConfig
    from fedpar.client.trainer import LocalTrainer
    from fedpar.datasets.arrays import ArrayDataset
    rng = np.random.default_rng(seed)
    data = ArrayDataset(rng.standard_normal((64, 16)).astype(np.float32), rng.integers(0, 4, 64))
    config = AgentConfig(server=address, agent_id=agent_id, poll_seconds=2.0, give_up_after=60.0,
                         credentials=credentials, insecure=credentials is None, data_tls=data_tls, seed=seed,
                         initial_backoff=0.05, max_backoff=0.5)
    return Agent(config, LocalTrainer(tiny_model(), data, seed=seed, seconds_per_step_delay=train_seconds / 2))


@dataclass
class AttackRun:
    """Round times of one run: undisturbed rounds first, then rounds while the attacker ran."""

    before: list[float]
    during: list[float]
    rows: list[dict]
    attacker: Counter = field(default_factory=Counter)
    agents: list = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Median round time under attack over the undisturbed median."""
        return statistics.median(self.during) / statistics.median(self.before)


def run_under_attack(server, attack, n_agents: int = 3, before: int = 3, during: int = 3,
                     train_seconds: float = 0.1, agent_kwargs=None, timeout: float = 120.0) -> AttackRun:
    """Run ``before + 1 + during`` rounds of ``server`` (a CoordinatorServer configured for that many rounds and
    ``n_agents`` agents, not started) with real agents. ``attack(server, start, stop, out)`` returns the attacker
    process's target and args (or ``attack`` is None: no attacker). Rounds 2..before are the undisturbed ones
    (the first warms up); the attacker starts when round ``before`` ends, and the round after that is not
    measured either (the attack ramps up). ``agent_kwargs(i)``: more honest_agent arguments for agent ``i``."""
    ctx = mp.get_context("spawn")
    start, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    server.coordinator.on_round_end.append(lambda row: start.set() if row["round"] == before else None)
    rows: list[dict] = []  # a short run's rows, as they end (the coordinator keeps none in memory)
    server.coordinator.on_round_end.append(rows.append)
    server.start()
    proc = None
    if attack is not None:
        target, args = attack(server, start, stop, out)
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
    agents = [honest_agent(server.address, f"honest-{i}", train_seconds, seed=i,
                           **(agent_kwargs(i) if agent_kwargs else {})) for i in range(n_agents)]
    threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
    for t in threads:
        t.start()
    found = Counter()
    try:
        if not server.wait(timeout):
            raise TimeoutError(f"the rounds did not finish in {timeout} s: {rows}")
    finally:
        stop.set()
        start.set()
        if proc is not None:
            try:
                found = out.get(timeout=20)
            except Exception:  # the attacker's report is a nicety; the rounds are the result
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        for a in agents:
            a.stop()
        server.stop(grace=0.2)
        for t in threads:
            t.join(10)
    seconds = [r["round_seconds"] for r in rows]
    return AttackRun(seconds[1:before], seconds[before + 1:], rows, found, agents)
