"""The one-shot form of ``fedpar serve`` (no ``--state``): a run service that runs one run and stops.

The run is built from serve's flags and kept in an in-memory run store; :class:`RunService` drives its rounds as
it drives a long-lived service's. This form writes into --out itself (and resumes from --checkpoint-dir), prints
the round table and a progress bar, tells the agents that training is over at the end, and exits with the run's
code (130/143 after SIGINT/SIGTERM, with the summary of the rounds that completed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from fedpar.cli.observability import Observers
from fedpar.cli.privacy import PRIVACY_COLUMNS, privacy_on
from fedpar.cli.progress import COLUMNS, LiveBar, RoundTable
from fedpar.cli.run_settings import effective_settings
from fedpar.cli.serve_service import RunService, json_ready
from fedpar.cli.task_options import task_label
from fedpar.cli.user_errors import hold_output_folder, run_exit_code
from fedpar.parallel.stopping import signal_name
from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.codec import grpc_target
from fedpar.wording import counted
from fedpar.server.checkpoint import has_checkpoint
from fedpar.server.run_store import RunStore
from fedpar.simulations.run_outputs import EarlierRun, RunOutputs, earlier_run_in, import_plots_ahead


class OneShotService(RunService):
    """A RunService whose one run writes where serve's flags say, shows its rounds on the terminal and ends the
    agents' training with it."""

    keeps_members = False  # the agents hear that training is over, and stop
    samples_by_task = False  # its own rule instead, set in watch(): see same_task
    records_rounds = False  # its store lives in memory and no one follows it: the rows are in --out's metrics.jsonl

    def __init__(self, args: argparse.Namespace, store: RunStore, plan: Callable, earlier: EarlierRun | None = None):
        super().__init__(args, store, args.port, plan)
        self.observers = Observers(argparse.Namespace(**{**vars(args), "tensorboard": None}))
        self.progress: LiveBar | None = None
        self.server = None  # the run's coordinator server, once built
        self.earlier = earlier  # an earlier run's outputs in --out, set aside until this run ends

    def settle_earlier(self) -> bool:
        """The earlier run's outputs back, if this run wrote no round (refused, stopped or failed before one), else
        let go; whether they were put back."""
        if self.earlier is None:
            return False
        restored = self.earlier.settle()
        self.earlier = None
        return restored

    def options_of(self, run) -> argparse.Namespace:
        """serve's own options: --out, --checkpoint-dir and the rest as given."""
        return self.args

    def tensorboard_dir(self, run) -> str | None:
        """--tensorboard itself."""
        return self.args.tensorboard

    def round_callbacks(self, plan, ranks) -> list[Callable[[dict], None]]:
        """The progress bar and the round table (with per-rank columns under aggregator ranks)."""
        from fedpar.server.rounds import rank_columns

        columns = COLUMNS + (PRIVACY_COLUMNS if privacy_on(self.args) else [])
        if ranks is not None:
            columns = columns + rank_columns(ranks.world)
        self.progress = LiveBar(total=plan.config.rounds)
        return [self.progress.round_ended,
                RoundTable(total=plan.config.rounds, columns=columns).row]

    def watch(self, server, run) -> None:
        """The port file as soon as health checks are answered (NOT_SERVING while a checkpoint is restored)."""
        self.server = server
        if not getattr(self.args, "flower_app", None):  # a Flower App's agents declare no task of their own
            members, task = server.coordinator.members, task_label(self.args)
            members.refuse_other_tasks(task_flags(self.args), same_task)
            server.coordinator.sample_only(task, lambda agent, why: self._refused(run, why))
        if self.args.port_file:
            server.on_listening = lambda port: atomic_write_bytes(self.args.port_file, [f"{port}\n".encode()])

    def _refused(self, run, line: str) -> None:
        """An agent refused for its task: said on the terminal too (the agent says it, and exits), as a warning: the
        run goes on with the agents that have its task ('fedpar serve: LINE' alone is how serve says it stops)."""
        print(f"fedpar serve: warning: {line}; this run goes on without it", file=sys.stderr, flush=True)
        self.store.log(run.id, line)

    def listening(self, server, plan) -> None:
        """The Prometheus endpoint, and where agents dial."""
        super().listening(server, plan)
        self.observers.attach(server)
        security = plan.security
        where = grpc_target(self.args.host, server.port)
        if server.coordinator.round_id >= plan.config.rounds:  # resumed with every round done: it waits for no one
            print(f"coordinator listening on {where} ({security.description}) only to tell agents that training is "
                  "over", flush=True)
            return
        print(f"coordinator listening on {where} ({security.description}); waiting for "
              f"{counted(plan.config.min_available, 'agent')} (start them with: fedpar client --server "
              f"{where} {security.client_hint} --agent-id ID ...)", flush=True)

    def waiting(self, server) -> None:
        """The progress bar follows the open round; a wait for agents after a round (the listening line says the
        first) is said as a service's run says it (RunService)."""
        self.progress.follow(server.coordinator)
        if server.coordinator.round_id >= 1:
            super().waiting(server)

    def wait_line(self, run, task: str, need: int, with_task: list[str], connected: list[str], why: str) -> str:
        """What the coordinator waiting for --min-available (or --min-reports) agents says."""
        option = "--min-reports" if why.startswith("min_reports") else "--min-available"
        return (f"waiting for {counted(need, 'agent')} ({option}): {len(with_task)} connected now "
                f"({', '.join(with_task) or 'none'})")

    def say_waiting(self, run, line: str, first: bool) -> None:
        """``line`` on stderr each time a service's run would log it (the round table stands still meanwhile)."""
        print(f"fedpar serve: {line}", file=sys.stderr, flush=True)

    def round_error(self, exc: Exception, config) -> str:
        """Re-raised: the command ends with it (a file it could not write says which checkpoint is kept)."""
        from fedpar.server.checkpoint import note_resume

        if isinstance(exc, OSError):  # a full disk or an unwritable folder: one line (cli/main.py), and how to go on
            note_resume(exc, config.checkpoint_dir)
        raise exc

    def title(self, run, args: argparse.Namespace) -> str:
        """What was trained, as `fedpar simulate` titles its plots."""
        return f"{args.task or f'{args.dataset} / {args.model}'}, fedpar serve"

    def _say(self, run, line: str) -> None:
        """Into the run's log only: the terminal has the round table."""
        self.store.log(run.id, line)


def task_kind(label: str) -> str:
    """What of a declared task (cli/task_options.py task_label) one-shot serve's agents must share: a built-in one's
    model and kind of data (each site names its own data file), a --task's reference (its --task-option values may
    be a site's own, as a data path; options that make another model still fail the agent's download)."""
    model, on, data = label.partition(" on ")
    if on and ":" not in model and " " not in model:
        return f"{model} on {data.partition(':')[0]}"
    return label.split(" ", 1)[0]


def same_task(declared: str, needed: str) -> bool:
    """Whether an agent that declared task ``declared`` can take part in one-shot serve's run of ``needed``."""
    return task_kind(declared) == task_kind(needed)


def task_flags(args: argparse.Namespace) -> str:
    """serve's flags that say what it trains, as an agent gives them."""
    if args.task:
        return f"--task {args.task}"
    return f"--model {args.model} --dataset {args.dataset}"


def serve_once(args: argparse.Namespace, plan, ranks=None) -> int:
    """Run the one run serve's flags describe (``plan``: its parts, built; ``ranks``: the RankLeader of the other
    aggregator ranks), print its summary and return the command's exit code."""
    with hold_output_folder(args.out):  # as simulate and train: export (and another run) can tell a run writes there
        return _serve_once(args, plan, ranks)


def _serve_once(args: argparse.Namespace, plan, ranks) -> int:
    """:func:`serve_once`, with --out held."""
    if args.plot:
        import_plots_ahead()
    store = RunStore(":memory:")
    # a run that resumes its checkpoint goes on with the rows beside it
    service = OneShotService(args, store, lambda options: plan,
                             earlier_run_in(Path(args.out), has_checkpoint(plan.config.checkpoint_dir)))
    run = store.get(store.submit("serve", json_ready(effective_settings(args))))
    try:
        end = service.execute(run, plan, ranks)
    finally:
        if service.progress is not None:
            service.progress.close()
        service.observers.close()
        store.close()
        kept_earlier = service.settle_earlier()  # no round written: nothing of the earlier run is lost
    if end.outputs is None:
        print(f"fedpar serve: {end.reason}", file=sys.stderr)
        return end.code
    metrics = service.server.coordinator.metrics
    if metrics.last:
        print(json.dumps({"rounds": metrics.summary.rounds, "final": metrics.last}, indent=2))
    print(RunOutputs(end.outputs.summary, [] if kept_earlier else end.outputs.written).wrote_line(Path(args.out)))
    return run_exit_code("fedpar serve", end.outputs.summary,
                         signal_name(end.stopped_by) if end.stopped_by is not None else None, args.task)
