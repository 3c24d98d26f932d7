"""Command-line options for the coordinator's hardening limits (their dests are CoordinatorConfig fields)."""

from __future__ import annotations

import argparse

from fedpar.cli.argtypes import count, fraction, non_negative, positive
from fedpar.server.config import CoordinatorConfig


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """Add every admission limit of ``fedpar serve`` as an option; refusals name the option to raise."""
    d = CoordinatorConfig()
    g = p.add_argument_group("limits", "refusals are RESOURCE_EXHAUSTED (or INVALID_ARGUMENT for malformed "
                                       "input) with a message naming the option")
    g.add_argument("--max-model-bytes", type=count, default=d.max_model_bytes,
                   help="largest model (sum of tensor bytes) an upload header may describe")
    g.add_argument("--max-upload-chunks", type=count, default=d.max_upload_chunks,
                   help="most data chunks in one upload (the chunk size itself is --max-chunk-bytes)")
    g.add_argument("--max-calls-per-agent", type=count, default=d.max_calls_per_agent,
                   help="calls/streams one agent may have in flight at once (long-poll, heartbeat, "
                        "download, upload)")
    g.add_argument("--max-upload-attempts", dest="max_upload_attempts_per_round", type=count,
                   default=d.max_upload_attempts_per_round,
                   help="uploads one agent may start per round (retries after a broken-off upload)")
    g.add_argument("--max-upload-bytes-per-second", type=positive, default=d.max_upload_bytes_per_second,
                   help="per-agent upload rate in bytes/s after a burst of two models; unset: unlimited")
    g.add_argument("--max-agents", type=count, default=d.max_agents,
                   help="registered agents; a Join from a new agent beyond this is refused")
    g.add_argument("--upload-header-seconds", type=positive, default=d.upload_header_seconds,
                   help="a call must send its request (an upload stream: its header) within this time; nothing is "
                        "authenticated before")
    g.add_argument("--upload-idle-seconds", type=positive, default=d.upload_idle_seconds,
                   help="a staged upload silent this long loses its staging slot (the agent may send it again)")
    g.add_argument("--upload-min-bytes-per-second", type=non_negative, default=d.upload_min_bytes_per_second,
                   help="a staged upload slower than this on average (from 2 s after it got its staging slot, or "
                        "--upload-idle-seconds if shorter) loses its slot; while others wait for a slot, at once")
    g.add_argument("--max-unauthenticated-calls", type=count, default=d.max_unauthenticated_calls,
                   help="calls still waiting for their request or upload header (not yet authenticated), in total; "
                        "they never count against --max-concurrent-rpcs, and beyond this the oldest is let go")
    g.add_argument("--max-unauthenticated-per-peer", type=count, default=d.max_unauthenticated_per_peer,
                   help="the same, from one peer (its certificate's name, else its address)")
    g.add_argument("--dataplane-handshake-seconds", type=positive, default=d.dataplane_handshake_seconds,
                   help="a data-plane connection must finish its TLS handshake and send its ticket (and upload "
                        "header) within this time; until then it holds no transfer thread")
    g.add_argument("--max-dataplane-handshakes", type=count, default=d.max_dataplane_handshakes,
                   help="data-plane connections not yet authenticated, in total; beyond this the oldest is closed")
    g.add_argument("--max-dataplane-handshakes-per-peer", type=count, default=d.max_dataplane_handshakes_per_peer,
                   help="the same, from one address")
    g.add_argument("--max-agent-share", type=fraction, default=d.max_agent_share,
                   help="cap on one update's share of a round's total weight, e.g. 0.5 (unset: no cap); heavier "
                        "updates are weighted down to it when the round closes (streaming strategies)")
    g.add_argument("--max-examples-per-agent", type=count, default=d.max_examples_per_agent,
                   help="largest example count an agent may declare at Join; FedAvg weighs its updates by at most "
                        "that times the local epochs (the count is fixed by its first Join)")
    g.add_argument("--max-joins-per-second", type=positive, default=d.max_joins_per_second,
                   help="server-wide Join rate, with a burst of five seconds' worth")
    g.add_argument("--max-queued-uploads", type=count, default=d.max_queued_uploads,
                   help="uploads staged or waiting for a staging slot; beyond this agents are told to retry")
    g.add_argument("--max-concurrent-downloads", type=count, default=d.max_concurrent_downloads,
                   help="weight downloads streamed at once; further downloads wait their turn")
    g.add_argument("--max-concurrent-rpcs", type=count, default=d.max_concurrent_rpcs,
                   help="server-wide calls in flight (every agent holds a long-poll, so keep it > 2 x agents)")
