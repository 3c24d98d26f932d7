"""What one host round trip costs in gRPC alone on this machine: the latency and the CPU (coordinator side and host
side, from /proc) of one small update (issue 25's 10-of-100 cell: a digits MLP's partial, about 38 KB, answered by a
verdict of a few bytes) sent four ways to a grpc.aio server in its own process, with no fedpar code in the way:

- ``unary``: a plain unary call (gRPC reads the request itself);
- ``direct``: a unary call served as a request stream whose one request the handler reads itself, with no bound;
- ``guarded``: the same, its request read under a time bound, as every fedpar unary call is (server/limits.py,
  RpcLimit._request: a stranger's call that sends no request is let go);
- ``stream``: one message each way on a long-lived bidirectional stream (a host's one stream for all its calls).

One command: ``.venv/bin/python benchmarks/grpc_call_cost.py [--calls 2000] [--pairs 5]``. The ways alternate, pass by
pass, so each sees the same load; it prints each way's medians over the passes and their ratios to ``unary``. Writes
benchmarks/results/grpc_call_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results import write_results  # noqa: E402  (benchmarks/, this script's folder)

from fedpar.cli.argtypes import FedparParser  # noqa: E402

WAYS = ("unary", "direct", "guarded", "stream")
REQUEST = b"\x01" * 38_440  # a digits MLP's weights (9,610 float32)
REPLY = b"\x08\x01\x12\x1f2 updates accepted for round 17"
TICK = os.sysconf("SC_CLK_TCK")


def _serve() -> None:
    """The server process: print the port, serve until stdin closes."""
    import grpc

    identity = lambda b: b  # noqa: E731

    async def unary(request, context):
        return REPLY

    def _seen(future):
        if not future.cancelled():
            future.exception()

    async def direct(request_iterator, context):
        await request_iterator.__anext__()
        return REPLY

    async def guarded(request_iterator, context):
        coming = asyncio.ensure_future(request_iterator.__anext__())
        coming.add_done_callback(_seen)
        await asyncio.wait((coming,), timeout=0.25)
        if not coming.done():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no request")
        coming.result()
        return REPLY

    async def stream(request_iterator, context):
        async for _ in request_iterator:
            yield REPLY

    async def main():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 20)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench", {
            "unary": grpc.unary_unary_rpc_method_handler(unary, identity, identity),
            "direct": grpc.stream_unary_rpc_method_handler(direct, identity, identity),
            "guarded": grpc.stream_unary_rpc_method_handler(guarded, identity, identity),
            "stream": grpc.stream_stream_rpc_method_handler(stream, identity, identity)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(0)
    asyncio.run(main())


def _cpu_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


class _Stream:
    """One long-lived stream: send a request, wait for its reply (the request iterator is fed from a queue)."""

    def __init__(self, channel):
        self.requests: queue.Queue = queue.Queue()
        self.replies = channel.stream_stream("/bench/stream")(iter(self.requests.get, None))

    def __call__(self, request: bytes) -> bytes:
        self.requests.put(request)
        return next(self.replies)

    def close(self) -> None:
        self.requests.put(None)


def _pass(call, server_pid: int, calls: int) -> dict:
    """``calls`` round trips: median latency, and the server's and this process's CPU per call, in microseconds."""
    latencies = []
    server0, client0 = _cpu_ticks(server_pid), time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        call(REQUEST)
        latencies.append(time.perf_counter() - start)
    server_us = (_cpu_ticks(server_pid) - server0) / TICK / calls * 1e6
    return {"latency_us": statistics.median(latencies) * 1e6, "server_cpu_us": server_us,
            "host_cpu_us": (time.process_time() - client0) / calls * 1e6}


def main() -> int:
    """Start the server, alternate the ways, print and write the medians and ratios."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="round trips per way and pass")
    p.add_argument("--pairs", type=int, default=5, help="passes over the ways")
    p.add_argument("--json", type=Path, default=HERE / "results" / "grpc_call_cost.json")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        _serve()
        return 0
    import grpc

    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        port = int(server.stdout.readline())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 1 << 20)])
        stream = _Stream(channel)
        calls = {"unary": channel.unary_unary("/bench/unary"), "direct": channel.unary_unary("/bench/direct"),
                 "guarded": channel.unary_unary("/bench/guarded"), "stream": stream}
        for way in WAYS:  # warm up: connections, first calls
            _pass(calls[way], server.pid, 100)
        load_before = Path("/proc/loadavg").read_text().split()[:3]
        passes = {way: [] for way in WAYS}
        for _ in range(a.pairs):
            for way in WAYS:
                passes[way].append(_pass(calls[way], server.pid, a.calls))
        stream.close()
        load = Path("/proc/loadavg").read_text().split()[:3]
    finally:
        server.stdin.close()
        server.wait(10)
    medians = {way: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for way, runs in passes.items()}
    print(f"{a.pairs} passes of {a.calls} round trips per way ({len(REQUEST)} B up, {len(REPLY)} B back); load "
          f"average {' '.join(load_before)} before, {' '.join(load)} after")
    print(f"{'way':<9}{'latency us':>12}{'server CPU us':>15}{'host CPU us':>13}   (medians; ratios to unary)")
    ratios = []
    for way, m in medians.items():
        base = medians["unary"]
        print(f"{way:<9}{m['latency_us']:>12.0f}{m['server_cpu_us']:>15.0f}{m['host_cpu_us']:>13.0f}   "
              f"{m['latency_us'] / base['latency_us']:.2f}x {m['server_cpu_us'] / base['server_cpu_us']:.2f}x "
              f"{m['host_cpu_us'] / base['host_cpu_us']:.2f}x")
        if way != "unary":
            for key, what in (("latency_us", "latency"), ("server_cpu_us", "server CPU"), ("host_cpu_us", "host CPU")):
                ratios.append({"what": f"{what} of one small update sent as '{way}'", "ratio": m[key] / base[key],
                               "against": "a plain unary call, same run"})
    write_results(a.json, ratios, {"calls": a.calls, "pairs": a.pairs, "request_bytes": len(REQUEST),
                                   "medians": medians, "passes": passes, "load_average_before": load_before,
                                   "load_average_after": load})
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
