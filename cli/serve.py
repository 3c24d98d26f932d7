"""Run the coordinator: agents dial in, rounds run, the global model is checkpointed every round.

Writes OUT/metrics.jsonl and metrics.csv (one line per round), OUT/summary.json at the end (also after Ctrl-C),
and, with --checkpoint-dir, resumes after a restart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from fedpar.cli.argtypes import at_least_one, count, fraction, non_negative_int, port, positive
from fedpar.aggregation import build_strategy, strategy_names
from fedpar.cli.compression_options import add_compression_arguments, compression_from_args
from fedpar.cli.dp import DP_COLUMNS, add_dp_arguments, dp_strategy
from fedpar.cli.limit_options import add_limit_arguments
from fedpar.cli.progress import COLUMNS, RoundTable
from fedpar.cli.strategy_options import add_strategy_option_argument, strategy_options_from_args
from fedpar.cli.tlsopts import add_tls_arguments, server_security
from fedpar.cli.observability import Observers, add_observability_arguments
from fedpar.cli.user_errors import check_output_folder, check_port_free, run_exit_code
from fedpar.datasets import load_dataset
from fedpar.parallel.device import DEVICE_HELP, check_device_layout, flush_denormals, resolve_device
from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.server.aggregator_ranks import RankLeader, check_ranks_supported, rank_columns
from fedpar.server.app import CoordinatorServer
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.rank_group import first_line
from fedpar.server.config import CoordinatorConfig
from fedpar.server.metrics import summarize_rounds
from fedpar.simulations.synthetic_coordinator import synthetic_model
from fedpar.server.secure_round import check_secure_setup


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar serve``."""
    d = CoordinatorConfig()
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=port, default=50051, help="port to listen on (0 picks a free one)")
    p.add_argument("--model", default="mlp", help="mlp or cnn; agents must use the same (or synthetic: see --params)")
    p.add_argument("--params", type=count, default=1_000_000,
                   help="with --model synthetic: a model of about this many float32 parameters and no data or "
                        "central evaluation, for benchmarks and load tests")
    p.add_argument("--dataset", default="digits",
                   help="digits or mnist: sets the model's input shape, and the test set for central evaluation")
    p.add_argument("--data-dir", help="folder with the MNIST files (for --dataset mnist)")
    p.add_argument("--no-central-eval", action="store_true", help="skip evaluating on the server-side test set")
    p.add_argument("--accept-populations", action="store_true",
                   help="let simulation hosts (`fedpar simulate-workers`) register virtual populations: members "
                        "without certificates of their own, live while their host calls")
    p.add_argument("--clock", choices=("real", "virtual"), default="real",
                   help="with --accept-populations: 'virtual' runs the deadline and first-K on simulated time; hosts "
                        "report each member's finish time from its trace and only the first K in time train")
    p.add_argument("--device", default="auto", help=f"where central evaluation runs: {DEVICE_HELP}")
    p.add_argument("--strategy", default="fedavg",
                   help=f"aggregation strategy ({', '.join(strategy_names())}), or flower:package.module:Class "
                        "(or flower:file.py:Class) for a Flower strategy's aggregate_fit (pip install 'fedpar[flower]'; "
                        "it holds every update of a round)")
    add_strategy_option_argument(p, "serve")
    p.add_argument("--rounds", type=non_negative_int, default=d.rounds, help="rounds to run (0: none)")
    p.add_argument("--clients-per-round", type=count, default=d.clients_per_round,
                   help="K: accepted updates that close a round early")
    p.add_argument("--fraction", type=fraction, default=d.fraction,
                   help="alternative to --clients-per-round: K = fraction x live agents")
    p.add_argument("--min-available", type=count, default=d.min_available,
                   help="live agents needed before a round starts")
    p.add_argument("--min-reports", type=non_negative_int, default=d.min_reports,
                   help="fewer accepted updates than this fail the round; the model stays as it was")
    p.add_argument("--overselect", type=at_least_one, default=d.overselect,
                   help="sample ceil(K x overselect) agents so stragglers do not hold a round up")
    p.add_argument("--deadline", dest="deadline_seconds", type=positive, default=d.deadline_seconds,
                   help="straggler deadline in seconds; later updates are refused")
    p.add_argument("--local-epochs", type=count, default=d.local_epochs, help="local epochs per task")
    p.add_argument("--batch-size", type=count, default=d.batch_size, help="local batch size")
    p.add_argument("--lr", dest="learning_rate", type=positive, default=d.learning_rate, help="local learning rate")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for initial weights and sampling")
    p.add_argument("--heartbeat", dest="heartbeat_seconds", type=positive, default=d.heartbeat_seconds,
                   help="seconds between agent heartbeats")
    p.add_argument("--liveness-timeout", dest="liveness_timeout_seconds", type=positive,
                   default=d.liveness_timeout_seconds, help="an agent silent this long is not sampled")
    p.add_argument("--max-chunk-bytes", type=count, default=d.max_chunk_bytes, help="largest tensor chunk accepted")
    p.add_argument("--inline-weights-bytes", dest="inline_weights_max_bytes", type=non_negative_int,
                   default=d.inline_weights_max_bytes,
                   help="models up to this size (and one chunk) travel inside each task instead of a separate "
                        "download call; every task reply of a round carries a copy; 0 = always download")
    p.add_argument("--max-concurrent-uploads", type=count, default=d.max_concurrent_uploads,
                   help="uploads staged at once (each holds one model copy)")
    p.add_argument("--data-plane", choices=["auto", "on", "off"], default="auto",
                   help="move weights over a bulk socket beside gRPC (TLS with the same certificates when gRPC "
                        f"uses TLS): auto = for models of at least {d.data_plane_min_bytes >> 20} MiB; agents "
                        "that do not support it keep using the gRPC streams")
    p.add_argument("--data-port", type=port, default=d.data_port,
                   help="port of the data plane on --host (0 picks a free one; agents learn it with each task)")
    p.add_argument("--secure-aggregation", action="store_true",
                   help="SecAgg+ masking: the coordinator learns only the weighted mean of the agents' updates "
                        "(needs a linear strategy: fedavg, fedavgm, fedprox, fedadam, fedyogi, fedadagrad)")
    p.add_argument("--secagg-clip", type=positive, default=d.secagg_clip,
                   help="with --secure-aggregation: clip each coordinate of an update (local - global) to +-this")
    p.add_argument("--secagg-max-weight", type=count, default=d.secagg_max_weight,
                   help="with --secure-aggregation: cap on an agent's weight (default: largest registered "
                        "examples x local epochs in the cohort)")
    p.add_argument("--secagg-stage-seconds", type=positive, default=d.secagg_stage_seconds,
                   help="with --secure-aggregation: longest wait for each key-exchange stage and for unmasking")
    add_compression_arguments(p)
    add_limit_arguments(p)
    p.add_argument("--aggregator-ranks", type=count, default=d.aggregator_ranks,
                   help="processes that share each round's downloads, uploads and fold, joined by an all-reduce "
                        "(rank r listens on --port + r, or a free port with --port 0; agents are told which rank "
                        "to use). Under torchrun every launched process is one rank and this is ignored")
    p.add_argument("--aggregator-timeout", dest="aggregator_timeout_seconds", type=positive,
                   default=d.aggregator_timeout_seconds,
                   help="longest wait for another aggregator rank at a round's close; a rank that misses it is "
                        "named and the whole coordinator stops (restart it with the same command to resume)")
    p.add_argument("--checkpoint-dir", type=Path,
                   help="checkpoint every round here, and resume from it after a restart (same model and strategy)")
    p.add_argument("--port-file", type=Path,
                   help="once listening, write the bound port to this file (handy with --port 0)")
    p.add_argument("--out", type=Path, default=Path("runs/serve"),
                   help="folder for metrics.jsonl, metrics.csv and summary.json")
    add_dp_arguments(p, population_flag=True)
    add_tls_arguments(p, "serve")
    add_observability_arguments(p)


@dataclass
class ServePlan:
    """What ``fedpar serve`` checked and built before listening."""

    config: CoordinatorConfig
    security: object
    assembly: CoordinatorAssembly
    strategy: object


def _plan(args: argparse.Namespace, rank: int = 0) -> ServePlan:
    """Settings, security, model and strategy from ``args`` (ValueError saying what to fix); ranks other than 0
    keep no metrics, checkpoints or central evaluation."""
    fields = set(CoordinatorConfig.__dataclass_fields__)
    config = CoordinatorConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    config.metrics_path = args.out / "metrics.jsonl" if rank == 0 else None
    config.virtual_clock = getattr(args, "clock", "real") == "virtual"
    if rank:
        config.checkpoint_dir = None
        config.data_port = config.data_port + rank if config.data_port else 0
    choice = getattr(args, "data_plane", None)  # a --config TOML file may give a bool
    config.data_plane = choice if choice is None or isinstance(choice, bool) else \
        {"auto": None, "on": True, "off": False}.get(choice, choice)
    security = server_security(args)  # first: a missing certificate should not wait for data loading
    check_device_layout(args.device)
    config.upload_compression = compression_from_args(args)
    config.validate()
    strategy_options = strategy_options_from_args(args)
    if args.model == "synthetic":
        assembly = CoordinatorAssembly(*synthetic_model(args.params, args.seed))
    else:
        splits = load_dataset(args.dataset, args.data_dir)
        eval_device = None if args.no_central_eval or rank else resolve_device(args.device)
        assembly = CoordinatorAssembly.for_data(args.model, splits, args.seed, eval_device)
    if args.dp != "off" and config.fraction is not None:
        raise ValueError("--dp needs a fixed cohort: use --clients-per-round instead of --fraction")
    name, options = dp_strategy(args, args.strategy, config.clients_per_round, config.overselect,
                                args.dp_population)
    strategy = build_strategy(name, **strategy_options, **options)
    if config.secure_aggregation:
        check_secure_setup(assembly.names, assembly.weights, strategy)
    if config.max_agent_share is not None:  # before any checkpoint is read: say what is wrong, not "resume"
        strategy.cap_shares(config.max_agent_share)
    check_ranks_supported(_world(args), strategy, config.secure_aggregation, config.max_agent_share)
    return ServePlan(config, security, assembly, strategy)


def _world(args: argparse.Namespace) -> int:
    """Aggregator ranks: torchrun's WORLD_SIZE when launched by it, else --aggregator-ranks."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else args.aggregator_ranks


def run(args: argparse.Namespace) -> int:
    """Serve until every round is done (in ``--aggregator-ranks`` local processes when more than one)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    flush_denormals()
    check_output_folder(args.out)
    if "WORLD_SIZE" not in os.environ:  # under torchrun each rank binds its own port
        check_port_free(args.host, args.port)
        check_port_free(args.host, args.data_port, "--data-port")
    try:
        plan = _plan(args)
    except ValueError as exc:
        print(f"fedpar serve: {exc}", file=sys.stderr)
        return 2
    world = _world(args)
    if world > 1 and "WORLD_SIZE" not in os.environ:
        from fedpar.parallel.init import spawn
        try:
            spawn(world, serve_rank, _plain_options(args))
        except Exception as exc:  # a rank died or hung: the others were stopped with it
            print(f"fedpar serve: an aggregator rank failed: {_rank_failure(exc)}; run the same command again to "
                  "resume after the last checkpointed round", file=sys.stderr)
            return 1
        return 0
    if world > 1:  # one rank of a torchrun-launched group
        from fedpar.parallel.init import exit_rank_process
        serve_rank(args)
        exit_rank_process(0)  # a finished rank leaves without the teardown that can abort (parallel/init.py)
    return _serve(args, plan)


def _rank_failure(exc: BaseException) -> str:
    """What went wrong in a spawned rank: its RankMissing line when it raised one, else the launcher's first line."""
    missing = [line.split("RankMissing: ", 1)[1] for line in str(exc).splitlines() if "RankMissing: " in line]
    return missing[0] if missing else first_line(exc)


def _plain_options(args: argparse.Namespace) -> dict:
    """The parsed options a spawned rank needs (values only: no handlers or modules)."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, Path, list, tuple, type(None)))}


def serve_rank(args: argparse.Namespace | dict) -> None:
    """One aggregator rank (spawned here, or launched by torchrun): rank 0 serves as the coordinator."""
    if isinstance(args, dict):
        args = argparse.Namespace(**args)
    from fedpar.parallel.init import init_distributed, shutdown_distributed
    from fedpar.server.rank_group import RankGroup

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    flush_denormals()
    rank = int(os.environ.get("RANK", "0"))
    plan = _plan(args, rank)
    init_distributed(plan.config.aggregator_timeout_seconds, args.device)
    group = RankGroup(plan.config.aggregator_timeout_seconds)
    advertised = "" if args.host in ("0.0.0.0", "::", "") else args.host
    try:
        code = _serve(args, plan, RankLeader(group, advertised)) if rank == 0 else \
            _serve_ingest(args, plan, group, advertised)
    finally:
        shutdown_distributed()
    if code:
        raise SystemExit(code)


def _serve_ingest(args: argparse.Namespace, plan: ServePlan, group, advertised: str) -> int:
    """Aggregator rank > 0: serve the agents rank 0 deals here until rank 0 says the rounds are done."""
    from fedpar.server.ingest_rank import IngestRank

    ingest = IngestRank(plan.config, plan.assembly.names, plan.assembly.weights, plan.strategy, group,
                        admission=plan.security.admission, advertised_host=advertised)
    port = args.port + group.rank if args.port else 0
    server = CoordinatorServer(ingest, host=args.host, port=port, credentials=plan.security.credentials,
                               data_tls=plan.security.data_tls)
    server.serve_to_end()
    return 0


def _serve(args: argparse.Namespace, plan: ServePlan, ranks=None) -> int:
    """Rank 0 (or the only rank): run the rounds, print the table, write metrics and checkpoints."""
    config, security = plan.config, plan.security
    columns = COLUMNS + (DP_COLUMNS if args.dp != "off" else [])
    if ranks is not None:
        columns = columns + rank_columns(ranks.world)
    table = RoundTable(total=config.rounds, columns=columns)
    observers = Observers(args)
    try:
        server = plan.assembly.server(config, plan.strategy, on_round_end=[table.row, *observers.round_callbacks()],
                                      admission=security.admission, host=args.host, port=args.port,
                                      credentials=security.credentials, data_tls=security.data_tls,
                                      ranks=ranks)  # data plane: TLS, same certificate
    except ValueError as exc:  # e.g. a damaged checkpoint, or one made with another model
        observers.close()
        print(f"fedpar serve: cannot resume: {exc}", file=sys.stderr)
        return 2
    try:
        server.start()
    except Exception as exc:
        observers.close()
        print(f"fedpar serve: {exc}; try another --port (0 picks a free one)", file=sys.stderr)
        return 1
    interrupted = False
    try:
        observers.attach(server)
        if args.port_file:
            atomic_write_bytes(args.port_file, [f"{server.port}\n".encode()])
        print(f"coordinator listening on {args.host}:{server.port} ({security.description}); waiting for "
              f"{config.min_available} agents (start them with: fedpar client --server {args.host}:{server.port} "
              f"{security.client_hint} --agent-id ID ...)", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        while not server.wait(0.5):
            if stop.is_set():
                break
        stop.wait(2.0)  # let agents hear "shutdown" on their next poll
    except KeyboardInterrupt:  # Ctrl-C: stop at once; what completed is checkpointed and summarized
        interrupted = True
    finally:
        server.stop(grace=0.5 if interrupted else 1.0)
        observers.close()
    rows = server.coordinator.metrics.rows
    summary = {**summarize_rounds(rows), "interrupted": interrupted}
    atomic_write_bytes(args.out / "summary.json", [(json.dumps(summary, indent=2) + "\n").encode()])
    if rows:
        print(json.dumps({"rounds": len(rows), "final": rows[-1]}, indent=2))
    return run_exit_code("fedpar serve", summary)
