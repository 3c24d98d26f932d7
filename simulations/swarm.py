"""Lightweight scripted agents on asyncio (raw gRPC, numpy, no torch): hundreds per process.

Each agent joins, long-polls for tasks, downloads the global weights, uploads them plus a little noise,
re-joins when the coordinator forgets it (restart) and backs off while it is unreachable. Used by the
load test and the restart benchmark; `python -m fedpar.simulations.swarm --help` runs a swarm.

Why not the real agent (client/agent.py)? It is one thread per agent plus a heartbeat thread, on blocking
gRPC, with torch for training: a few hundred per process at most. The load test needs thousands of agents
against one coordinator from a couple of processes, so these are coroutines on grpc.aio that do not train.
What does not depend on threads or asyncio is the agent's own code: the retry classes and jittered backoff
(client/backoff.py), the download's checks (client/transfer.WeightsReceiver), the upload messages and the
admission rule (client/transfer.upload_messages, waits_for_admission). What is written again here is the
asyncio control flow around them: the join/poll loop, the async admission wait, the async sleeps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import zlib
from dataclasses import asdict, dataclass

import grpc
from grpc._cython.cygrpc import ExecuteBatchError  # done_writing() on a call the server ended (not an AioRpcError)
import numpy as np

from fedpar.client.backoff import RETRYABLE, Backoff
from fedpar.client.stats import AgentStats
from fedpar.client.transfer import (UPLOAD_RETRYABLE, WeightsReceiver, download_request, ingest_address,
                                    upload_messages, waits_for_admission)
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.messages import PROTOCOL_VERSION, UPLOAD_ADMITTED, channel_options
from fedpar.protocol.stubs import CoordinatorStub


@dataclass
class SwarmStats(AgentStats):
    """What a swarm's agents did, summed: an agent's counts (``dropped`` stays 0: these never drop out), plus
    the swarm's own."""

    agents: int = 0
    backoffs: int = 0
    busy: int = 0  # uploads retried because the coordinator was busy
    finished: int = 0


async def _download(stub: CoordinatorStub, auth: pb.AgentAuth, task: pb.TrainTask, timeout: float):
    receiver = WeightsReceiver(None, 64 << 20)
    async for message in stub.DownloadWeights(download_request(auth, task), timeout=timeout):
        receiver.take(message)
    return receiver.layout, receiver.weights()


async def _upload(stub, auth, task, layout, update, chunk_bytes, stats: SwarmStats, rng) -> None:
    """Upload, retrying while the coordinator says it is busy (RESOURCE_EXHAUSTED) and time remains."""
    deadline_at = time.monotonic() + task.deadline_seconds
    backoff = Backoff(0.05, 1.0, rng)
    while True:
        messages = upload_messages(auth, task, layout, update, 100, 1, {}, chunk_bytes)
        try:
            await _send_when_admitted(stub, messages, timeout=max(5.0, deadline_at - time.monotonic() + 5))
            stats.accepted += 1
            return
        except grpc.aio.AioRpcError as err:
            # Busy coordinator or a broken connection: send again while the deadline allows.
            if not _retryable_upload_error(err) or not backoff.fits_before(deadline_at):
                raise
            stats.busy += 1
            await asyncio.sleep(backoff.wait())


async def _send_when_admitted(stub: CoordinatorStub, messages, timeout: float) -> pb.UploadReply:
    """The header, then the data (a large upload's once the coordinator admits it); raises AioRpcError if refused."""
    call = stub.UploadUpdate(timeout=timeout)
    header = next(messages)
    try:
        await call.write(header)
        if not waits_for_admission(header) or UPLOAD_ADMITTED in tuple(await call.initial_metadata() or ()):
            for message in messages:
                await call.write(message)
            await call.done_writing()
    except (asyncio.InvalidStateError, grpc.aio.UsageError, ExecuteBatchError):
        # The call ended while we wrote (refused, or the coordinator went away, e.g. killed): grpc.aio then fails
        # the write or the half-close, and the call's status says why.
        pass
    return await call  # refused: raises with the coordinator's status


def _retryable_upload_error(err: grpc.aio.AioRpcError) -> bool:
    """Whether an upload may be sent again. grpc.aio clients can report a server's early refusal of a
    client stream (here: the coordinator is busy) as INTERNAL "Internal error from Core" when a write
    loses the race with the server's status (grpc/grpc#36066); that is retried like the refusal."""
    if err.code() in UPLOAD_RETRYABLE:
        return True
    return err.code() == grpc.StatusCode.INTERNAL and "Internal error from Core" in (err.details() or "")


class IngestChannels:
    """The swarm's channels to the aggregator ranks its tasks name (server/ranks/), one per rank."""

    def __init__(self, server: str):
        self.server = server
        self.channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, task: pb.TrainTask, default: CoordinatorStub) -> CoordinatorStub:
        """The stub for the task's download and upload (``default``: the coordinator's, when it names no rank)."""
        address = ingest_address(self.server, task)
        if address == self.server:
            return default
        if address not in self.channels:
            self.channels[address] = grpc.aio.insecure_channel(address, options=channel_options(64 << 20))
        return CoordinatorStub(self.channels[address])

    async def close(self) -> None:
        """Close the ranks' channels."""
        await asyncio.gather(*(c.close() for c in self.channels.values()))


async def run_agent(channel: grpc.aio.Channel, agent_id: str, stats: SwarmStats, poll_seconds: float = 5.0,
                    max_backoff: float = 1.0, chunk_bytes: int = 1 << 20, ingest: IngestChannels | None = None) -> None:
    """One scripted agent until the coordinator says shutdown (its weights move through the rank its task names)."""
    stub = CoordinatorStub(channel)
    rng = np.random.default_rng(zlib.crc32(agent_id.encode()))
    auth, backoff = None, Backoff(0.05, max_backoff, rng)
    while True:
        try:
            if auth is None:
                reply = await stub.Join(pb.JoinRequest(agent_id=agent_id, num_examples=100,
                                                       protocol_version=PROTOCOL_VERSION), timeout=30)
                auth = pb.AgentAuth(agent_id=agent_id, token=reply.token)
            reply = await stub.PullTask(pb.PullTaskRequest(auth=auth, wait_seconds=poll_seconds),
                                        timeout=poll_seconds + 30)
            backoff.reset()
            kind = reply.WhichOneof("kind")
            if kind == "shutdown_reason":
                stats.finished += 1
                return
            if kind != "task":
                continue
            task = reply.task
            stats.tasks += 1
            moves = ingest.stub(task, stub) if ingest is not None else stub
            layout, arrays = await _download(moves, auth, task, timeout=max(5.0, task.deadline_seconds))
            update = [a + rng.standard_normal(a.shape).astype(a.dtype) * a.dtype.type(0.01)
                      if a.dtype.kind == "f" else a for a in arrays]
            await _upload(moves, auth, task, layout, update, chunk_bytes, stats, rng)
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                auth = None
                stats.reconnects += 1
            elif code in RETRYABLE:
                stats.backoffs += 1
                await asyncio.sleep(backoff.wait())
            else:  # a refused task (round closed, duplicate, ...): note it and pull again
                stats.refused += 1
                if len(stats.refusals) < 20:
                    stats.refusals.append(f"{agent_id}: {code.name}: {err.details()}")


async def run_swarm(address: str, ids: list[str], agents_per_channel: int = 1, poll_seconds: float = 5.0,
                    max_backoff: float = 1.0) -> SwarmStats:
    """Run scripted agents ``ids`` against ``address`` until all are told to shut down."""
    stats = SwarmStats(agents=len(ids))
    channels = [grpc.aio.insecure_channel(address, options=channel_options(64 << 20))
                for _ in range(0, len(ids), agents_per_channel)]
    ingest = IngestChannels(address)
    try:
        await asyncio.gather(*(run_agent(channels[i // agents_per_channel], agent_id, stats, poll_seconds,
                                         max_backoff, ingest=ingest) for i, agent_id in enumerate(ids)))
    finally:
        await asyncio.gather(*(c.close() for c in channels))
        await ingest.close()
    return stats


def main(argv: list[str] | None = None) -> int:
    """Command line: run a swarm and print its stats as JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--server", required=True, help="coordinator HOST:PORT")
    p.add_argument("--count", type=int, required=True, help="number of agents")
    p.add_argument("--prefix", default="swarm", help="agent ids are PREFIX-0000, PREFIX-0001, ...")
    p.add_argument("--first", type=int, default=0, help="index of the first agent id")
    p.add_argument("--agents-per-channel", type=int, default=1, help="agents sharing one connection")
    p.add_argument("--poll", type=float, default=5.0, help="long-poll seconds")
    p.add_argument("--max-backoff", type=float, default=1.0, help="longest reconnect wait")
    args = p.parse_args(argv)
    ids = [f"{args.prefix}-{i:05d}" for i in range(args.first, args.first + args.count)]
    start = time.monotonic()
    stats = asyncio.run(run_swarm(args.server, ids, args.agents_per_channel, args.poll, args.max_backoff))
    print(json.dumps({**asdict(stats), "seconds": time.monotonic() - start}), flush=True)
    return 0 if stats.finished == len(ids) else 1


if __name__ == "__main__":
    sys.exit(main())
