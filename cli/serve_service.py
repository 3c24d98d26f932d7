"""The long-lived form of ``fedpar serve`` (``--state PATH``): a federation that outlives its runs.

Runs are submitted on the control port (``fedpar run submit``), kept in a SQLite run store and executed one at a
time, each by a coordinator of its own. The agents' port is bound once for the service's life (server/agent_port.py):
an idle coordinator answers there between runs and each run's is stacked on it, sharing its agents, so agents stay
joined, with the sessions they have, from run to run (the port never closes, health stays SERVING). A run left
running when the service ended (a signal, a crash, kill -9) resumes from its last checkpoint at the next start.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fedpar.cli.observability import Observers, check_metrics_endpoint, check_tensorboard_folder, \
    tensorboard_resumes, tensorboard_writer
from fedpar.cli.run_settings import RUN_KEYS, effective_settings, run_args, run_settings
from fedpar.cli.task_options import task_label
from fedpar.cli.user_errors import UserError, check_port_free, check_rank_ports, describe, every_round_failed
from fedpar.parallel.stopping import signal_name, stop_on_signals
from fedpar.protocol import file_lock
from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.file_lock import FileLock
from fedpar.wording import counted
from fedpar.server.run_store import CANNOT_RESUME, TRIED_AGAIN, RunStore, StoreError, check_state_folder
from fedpar.settings import setting

IDLE_POLL_SECONDS = 0.5
WAIT_SAID_AFTER_SECONDS = 3.0  # a run waiting for agents says so after this long (agents re-join in about that)
WAIT_SAID_EVERY_SECONDS = 60.0  # and again in its log while it still waits


@dataclass
class ServiceOptions:
    """What the long-lived form of ``fedpar serve`` adds: where its runs are kept and its control port."""

    state: Path | None = setting(
        None, group="coordinator", metavar="PATH",
        help="run as a long-lived service keeping its runs in this SQLite file (runs' outputs go beside it, in "
             "PATH.runs/ID): runs are submitted with 'fedpar run submit' on --control-port and run one at a time; "
             "agents stay connected between runs. Without it, serve runs one run (these flags) and exits")
    control_port: int = setting(50052, check="port", group="coordinator",
                                help="with --state: port of the control API (mutual TLS with --certs; only "
                                     "certificates from 'fedpar certs --operators NAME' are answered)")
    control_port_file: Path | None = setting(None, check="file_to_write", group="coordinator",
                                             help="with --state: once listening, write the control port to this file")


def _lock(path: Path) -> FileLock:
    """An exclusive lock beside the state file: one service per state file, however a path names it (a symlink, a
    relative path: the resolved one is locked); UserError if another holds it."""
    lock = Path(f"{path.resolve()}.lock")
    try:
        return file_lock.hold(lock)
    except file_lock.LockHeld as held:
        by = f"another fedpar serve (pid {held.pid})" if held.pid else "another fedpar serve"
        raise UserError(f"state file {path} is in use by {by}; stop it, or give another --state") from None
    except OSError as exc:  # a folder where its lock file goes: was exit 1, '(--debug shows the traceback)'
        if not lock.exists() and not lock.is_symlink():  # nothing to move aside: the folder takes no file
            raise UserError(f"state file {path} cannot be locked: its folder {lock.parent} cannot be written "
                            f"({exc.strerror or exc}); give --state a path in a folder this user can write") from None
        raise UserError(f"state file {path} cannot be locked: {lock} is not a file this service can use "
                        f"({exc.strerror or exc}); move it aside, or give another --state") from None


def check_distinct_ports(args: argparse.Namespace) -> None:
    """UserError when two of the ports serve listens on (--port, --control-port with --state, --data-port,
    --metrics-port) are set to the same number: said before anything binds, not as the second bind's failure."""
    ports = [(args.port, "--port"), (args.control_port if args.state is not None else None, "--control-port"),
             (getattr(args, "data_port", None), "--data-port"), (getattr(args, "metrics_port", None), "--metrics-port")]
    seen: dict[int, str] = {}
    for port, option in ports:
        if port and port in seen:
            raise UserError(f"{seen[port]} and {option} are both {port}: each needs a port of its own")
        if port:
            seen[port] = option


def _check_one_shot_outputs(args: argparse.Namespace) -> None:
    """UserError for --out or --checkpoint-dir with --state: a service's runs write where it keeps them."""
    from fedpar.cli.run_settings import serve_parser

    given = [option for option, ignored in (("--out", args.out != serve_parser().get_default("out")),
                                            ("--checkpoint-dir", args.checkpoint_dir is not None)) if ignored]
    if given:
        raise UserError(f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} not used with --state: each run "
                        "writes its outputs and "
                        f"checkpoints to {args.state}.runs/ID/ (fetch them with 'fedpar run get ID --out DIR'); "
                        f"drop {' and '.join(given)}")


def foreign_runs(state: str, known: set[int]) -> str | None:
    """The line refusing a service whose ``STATE.runs`` folder holds run folders its state file does not know (an
    earlier state file's: a new run with the same id would resume their checkpoints), or is not a folder, else None."""
    runs_dir = Path(f"{state}.runs")
    if runs_dir.exists() and not runs_dir.is_dir():  # every run would fail at its start, 'Not a directory'
        return (f"{runs_dir} is a file, not a folder: the service keeps its runs' outputs there; move it aside, or "
                "give --state another path")
    try:
        ids = sorted(int(p.name) for p in runs_dir.iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:  # no such folder yet
        return None
    unknown = [i for i in ids if i not in known]
    if not unknown:
        return None
    shown = ", ".join(map(str, unknown[:5])) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
    return (f"{runs_dir} holds the outputs of run{'s' if len(unknown) > 1 else ''} {shown}, which state file {state} "
            f"does not know (an earlier state file's: a new run with that id would resume its checkpoints); move "
            f"{runs_dir} aside with the state file it belongs to, or give --state another path")


@dataclass
class RunEnd:
    """How :meth:`RunService.execute` left a run: its status (None: a signal stopped the service during it), why,
    the exit code of a run that could not start, and the outputs written (None if it did not start)."""

    status: str | None
    reason: str
    code: int = 0
    outputs: object = None
    stopped_by: KeyboardInterrupt | None = None


class RunService:
    """Executes the queued runs of ``store`` one after another on ``port``, with ``args`` as every run's base."""

    def __init__(self, args: argparse.Namespace, store: RunStore, port: int, plan: Callable, rank_group=None):
        self.args, self.store, self.port, self.plan = args, store, port, plan  # plan: serve's, args -> ServePlan
        self.rank_group = rank_group  # the ServiceRanks of the other aggregator ranks (cli/serve_ranks.py), or None
        self.runs_dir = Path(f"{args.state}.runs")
        self.observers = Observers(argparse.Namespace(**{**vars(args), "tensorboard": None}))  # one endpoint
        self.idle = None  # the idle coordinator's server, beneath every run on the agents' port (open_agents_port)
        self._current = None  # (the run executing, its task)
        self._wait: list | None = None  # while it waits for agents: [since, last said (monotonic), the line]

    def validate(self, settings: dict) -> tuple[dict, str]:
        """A submitted run's settings, checked as serve's options and by building its coordinator's parts, and a
        warning when no agent with its task is connected; ValueError when agents are, and none has its task. The
        settings returned are all of them, the service's flags for those the run file leaves out: a run keeps them
        whatever flags the service is restarted with."""
        checked = run_settings(settings, "run settings")
        args = run_args(self.args, {**checked, "out": str(self.runs_dir / "check")})
        try:
            config = self.plan(args).config
        except UserError as exc:
            raise ValueError(str(exc)) from None
        except OSError as exc:  # e.g. a dataset file that is not there: the service's machine's, not the operator's
            raise ValueError(f"{describe(exc)} (on the service's machine)") from None
        task, fixed = task_label(args), json_ready(effective_settings(args))
        declared = self._agents_now()
        if not declared:
            return fixed, f"no agent is connected now; the run waits for agents with task {task!r}"
        if task not in declared.values():
            has = "; ".join(f"{agent}: {declared[agent] or 'did not say'}" for agent in sorted(declared))
            raise ValueError(f"no connected agent has task {task!r} (they have: {has}); start agents with it, or "
                             "submit a task they have")
        joined = [agent for agent in sorted(declared) if declared[agent] == task]
        need, why = agents_needed(config)
        if len(joined) >= need:
            return fixed, ""
        return fixed, (f"the run needs {counted(need, 'agent')} with task {task!r} ({why}) and {len(joined)} "
                       f"{'is' if len(joined) == 1 else 'are'} joined now ({', '.join(joined)})")

    def _agents_now(self) -> dict[str, str | None]:
        """The task each agent connected now declared ({} while the agents' port is not open)."""
        if self.idle is None:
            return {}
        try:
            return self.idle.on_loop(self.idle.coordinator.members.declared_tasks, timeout=5.0)
        except (RuntimeError, TimeoutError):
            return {}

    def open_agents_port(self) -> int:
        """Bind the agents' port for the service's life, the idle coordinator answering there; returns the port
        (BindError when it cannot be bound)."""
        from fedpar.cli.declared import from_args
        from fedpar.cli.tlsopts import server_security
        from fedpar.server.agent_port import AgentPort
        from fedpar.server.config import CoordinatorConfig
        from fedpar.server.idle_coordinator import idle_server

        security = server_security(self.args)
        agents = AgentPort(from_args(CoordinatorConfig, self.args, checkpoint_dir=None), security.admission,
                           self.args.host, self.port, security.credentials)
        self.port = agents.open()
        self.idle = idle_server(agents)
        self.idle.start()
        return self.port

    def close_agents_port(self) -> None:
        """Stop the idle coordinator and close the agents' port."""
        if self.idle is not None:
            self.idle.stop(grace=0.2)
            self.idle.agent_port.close(grace=0.2)

    def serve_forever(self) -> None:
        """Run queued runs until a signal (KeyboardInterrupt) ends the service; the agents' port stays open, with
        the idle coordinator answering between runs (agents stay joined, health SERVING)."""
        while True:
            run = self.store.next_queued()
            if run is None:
                time.sleep(IDLE_POLL_SECONDS)
                continue
            end = self.execute(run)
            if end.stopped_by is not None:
                raise end.stopped_by

    def _on_agents_port(self) -> dict:
        """Where a run's coordinator serves: on the agents' port with the idle coordinator's agents, or (no port
        opened: the one-shot form, a simulation) on a port of its own."""
        if self.idle is None:
            return {}
        return {"agent_port": self.idle.agent_port, "members": self.idle.coordinator.members}

    # What one form of the service does differently from the other (cli/serve_once.py overrides these).
    keeps_members = True  # the next run takes the agents: they never hear that training is over
    samples_by_task = True  # only agents that declared the run's task are sampled
    records_rounds = True  # each round's row goes into the run store too, where 'fedpar run' followers read it

    def settle(self, run):
        """``run`` with all its settings stored: one submitted with its file's keys only (before services stored
        them all) takes the service's flags for the others once, at its next start, and keeps them."""
        if RUN_KEYS <= run.settings.keys():
            return run
        self.store.fix_settings(run.id, json_ready(effective_settings(run_args(self.args, run.settings))))
        return self.store.get(run.id)

    def options_of(self, run) -> argparse.Namespace:
        """The options of ``run``: its settings (all of them: see :meth:`settle`) over the service's, writing in
        PATH.runs/ID."""
        out = self.runs_dir / str(run.id)
        return run_args(self.args, {**run.settings, "out": str(out), "checkpoint_dir": out / "checkpoints"})

    def tensorboard_dir(self, run) -> str | None:
        """Where ``run``'s TensorBoard events go: a subfolder per run."""
        return str(Path(self.args.tensorboard) / f"run-{run.id}") if self.args.tensorboard else None

    def round_callbacks(self, plan, ranks) -> list[Callable[[dict], None]]:
        """What sees each round's metrics row besides the store and TensorBoard."""
        return []

    def watch(self, server, run) -> None:
        """Have the Prometheus endpoint follow ``server`` (before it starts): one endpoint, a run label."""
        self.observers.attach_run(server, run.id)

    def listening(self, server, plan) -> None:
        """``server`` started (the one-shot form says where agents dial)."""

    def waiting(self, server) -> None:
        """Twice a second while ``server``'s rounds run: while fewer than --min-available agents with the run's task
        are connected, the run's log says so (the service's stderr too, once a wait), again when who is connected
        changes, and every minute."""
        members, (need, why) = server.coordinator.members, agents_needed(server.coordinator.config)
        try:
            # (a server method, not a lambda of this file: the traced round's window would count this file by timing)
            with_task, connected = server.on_loop(members.live_and_connected_ids, timeout=2.0)
        except (RuntimeError, TimeoutError):
            return
        now = time.monotonic()
        if len(with_task) >= need:
            self._wait = None
            return
        if self._wait is None:
            self._wait = [now, None, ""]  # [waiting since, last said, what]
        since, said, what = self._wait
        run, task = self._current
        line = self.wait_line(run, task, need, with_task, connected, why)
        if now - since < WAIT_SAID_AFTER_SECONDS or (line == what and now - said < WAIT_SAID_EVERY_SECONDS):
            return
        self.say_waiting(run, line, first=said is None)
        self._wait[1:] = [now, line]

    def say_waiting(self, run, line: str, first: bool) -> None:
        """``line`` into the run's log, and the ``first`` of a wait on the service's stderr too."""
        self.store.log(run.id, line)
        if first:
            print(f"fedpar service: {line}", file=sys.stderr, flush=True)

    def wait_line(self, run, task: str, need: int, with_task: list[str], connected: list[str], why: str) -> str:
        """What a run waiting for ``need`` agents says: those connected with its task, and all those connected (and
        ``why`` it needs them when its min_reports, not the service's --min-available, sets it)."""
        because = f" ({why})" if why.startswith("min_reports") else ""
        return (f"run {run.id} waits for {counted(need, 'agent')} with task {task!r}{because}: {len(with_task)} "
                f"connected with it now ({', '.join(with_task) or 'none'}), {len(connected)} connected in all")

    def round_error(self, exc: Exception, config) -> str:
        """Why a run ended by ``exc`` (a round's error) failed: the service goes on with the next run (called in
        its ``except`` clause: raising there ends the service). A mistake a user can fix (a setting, a task, a file,
        too few agents) is its one line; anything else keeps its kind, for whoever reads the log."""
        if isinstance(exc, (UserError, ValueError, OSError)):
            return describe(exc)
        return f"{type(exc).__name__}: {exc}"

    def execute(self, run, plan=None, ranks=None) -> RunEnd:
        """Run ``run`` to its end (finished, failed or stopped; ``plan``: its parts built already, ``ranks``: the
        RankLeader of the other aggregator ranks); a signal leaves it running (``stopped_by``), to resume."""
        from fedpar.server.app import RestoreError

        run = self.settle(run)
        args = self.options_of(run)
        out = Path(args.out) if args.out else None  # None: a run that leaves no files (a simulation without --out)
        task = task_label(args)
        began = "resumed" if run.started is not None else "started"  # (a restart of the service resumes a run)
        self.store.start(run.id, str(out or ""))
        self._say(run, f"run {run.id} ({run.name}) {began}: task {task!r}, {args.rounds} rounds; only agents that "
                       "have its task are sampled")
        lost = lost_checkpoints(run, args.checkpoint_dir)
        if lost is not None:  # it started afresh from the initial model, its log saying it had resumed
            return self._end(run, "failed", f"{CANNOT_RESUME}{lost}; {TRIED_AGAIN}", said=f"{CANNOT_RESUME}{lost}",
                             code=2)
        events = None
        try:
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
            plan = plan or self.plan(args)
            events = tensorboard_writer(self.tensorboard_dir(run))
            if ranks is None and self.rank_group is not None:
                ranks = self.rank_group.leader_for(json_ready({**run.settings, "out": args.out,
                                                               "checkpoint_dir": args.checkpoint_dir}), plan)
            record = lambda row: self.store.record_round(run.id, json_ready(row))  # noqa: E731
            server = plan.assembly.server(
                plan.config, plan.strategy, on_round_end=[*([record] if self.records_rounds else []),
                                                          *self.round_callbacks(plan, ranks),
                                                          *([events.write] if events else [])],
                admission=plan.security.admission, host=self.args.host, port=self.port,
                credentials=plan.security.credentials, data_tls=plan.security.data_tls, ranks=ranks,
                **self._on_agents_port())
        except (ValueError, UserError, OSError) as exc:
            if events is not None:
                events.close()
            return self._end(run, "failed", f"cannot start: {describe(exc)}", said=describe(exc), code=2)
        if events is not None:
            tensorboard_resumes(events, server.coordinator)
        server.coordinator.keeps_members = self.keeps_members
        self._current, self._wait = (run, task), None
        if self.samples_by_task:
            server.coordinator.sample_only(task, lambda agent, why: self._say(run, why))
        started, status, reason, stopped_by = time.monotonic(), "failed", "", None
        try:
            self.watch(server, run)
            try:
                server.start()
            except RestoreError as exc:  # e.g. a damaged checkpoint, or one made with another model
                return self._end(run, "failed", f"{CANNOT_RESUME}{exc}; {TRIED_AGAIN}", said=f"{CANNOT_RESUME}{exc}",
                                 code=2)  # said: what a one-shot form (one run, no --state) exits with
            except (KeyboardInterrupt, UserError):
                raise
            except Exception as exc:  # the port is taken
                return self._end(run, "failed", f"{exc}; try another --port (0 picks a free one)", code=1)
            self.listening(server, plan)
            resumed = server.coordinator.metrics.last  # a kill between a round's checkpoint and its row here
            if (self.records_rounds and resumed is not None
                    and server.coordinator.round_id > self.store.get(run.id).round):
                record(resumed)
            while not server.wait(0.5):
                self.waiting(server)
                if self.store.stop_requested(run.id):
                    status = "stopped"  # its reason once the stop settled a round that was closing (below)
                    break
            else:
                status = "finished"
                self.linger(server)
        except KeyboardInterrupt as exc:  # the service is stopping: the run resumes at its next start
            status, stopped_by = None, exc
        except Exception as exc:  # a round's error ends this run (the one-shot form re-raises it)
            reason = self.round_error(exc, plan.config)
        finally:
            # on the service's port: the idle coordinator answers the agents again; a run stop waits for the row of
            # a round that was closing (its evaluation, checkpoint and row may take longer than the grace), so that
            # its reason, below, names the round its rows and 'fedpar run ls' hold
            server.stop(grace=0.5, settle=status == "stopped")
            if events is not None:
                events.close()
        earlier = server.coordinator.earlier_seconds  # a resumed run's time in the processes before this one
        outputs = self.outputs(out, server, plan, run, args,
                               {"wall_seconds": earlier + time.monotonic() - started,
                                "earlier_processes_seconds": earlier, "interrupted": status != "finished"},
                               plots=status is not None and args.plot)  # a signal's stop has none: it stops in 2 s
        if status is None:
            return RunEnd(None, "", outputs=outputs, stopped_by=stopped_by)
        if status == "stopped":  # the round its rows, 'fedpar run ls' and its summary hold: one value
            reason = f"stopped after round {self.store.get(run.id).round}"
        if status == "finished":  # as the one-shot form's exit code: a run none of whose rounds succeeded failed
            failed = every_round_failed(outputs.summary, args.task, "min_reports, deadline_seconds")
            status, reason = ("failed", failed) if failed else (status, reason)
        model = out / "global.safetensors" if out is not None else None
        return self._end(run, status, reason or outputs.summary.get("stopped_because", ""),
                         str(model) if model is not None and model.is_file() else "", outputs=outputs)

    def outputs(self, out: Path, server, plan, run, args: argparse.Namespace, extra: dict, plots: bool = True):
        """What ``run`` leaves in ``out`` once its coordinator ``server`` stopped (``extra``: for its summary;
        ``plots``: whether it gets its plots, unfinished too): the RunOutputs of :func:`write_run_outputs`."""
        from fedpar.simulations.run_outputs import write_run_outputs

        return write_run_outputs(out, server.coordinator, plan.assembly.description, extra, title=self.title(run, args),
                                 plots=plots)

    def title(self, run, args: argparse.Namespace) -> str:
        """The title of ``run``'s plots."""
        return f"run {run.id} ({run.name})"

    def _end(self, run, status: str, reason: str, model: str = "", said: str = "", code: int = 0,
             outputs=None) -> RunEnd:
        self._say(run, f"run {run.id} ({run.name}) {status}" + (f": {reason}" if reason else ""))
        self.store.end(run.id, status, reason, model)  # after its last line: a follower that sees it ended has all
        self.observers.run_ended(run.id, status)
        return RunEnd(status, said or reason, code, outputs)

    def linger(self, server) -> None:
        """After the last round, before the coordinator stops: let the agents hear that training is over
        (:func:`until_told`; a simulation waits for its worker processes instead)."""
        until_told(server.coordinator)

    def _say(self, run, line: str) -> None:
        """``line`` in the run's log ('fedpar run logs') and on the service's output."""
        self.store.log(run.id, line)
        print(line, flush=True)


def agents_needed(config) -> tuple[int, str]:
    """How many agents of its task a run of ``config`` needs, and why: a round starts once --min-available are
    connected, and fails with fewer than its min_reports updates."""
    if config.min_reports > config.min_available:
        return config.min_reports, f"min_reports = {config.min_reports}; its rounds fail with fewer"
    return config.min_available, f"the service's --min-available {config.min_available}; it waits for them"


def lost_checkpoints(run, checkpoint_dir: Path | None) -> str | None:
    """Why ``run``, which recorded rounds before the service last ended, cannot resume: its checkpoints (each round
    writes one before its row is recorded) are gone from ``checkpoint_dir``; None when it can, or has none to."""
    from fedpar.server.checkpoint import has_checkpoint

    if run.started is None or run.round < 1 or checkpoint_dir is None or has_checkpoint(checkpoint_dir):
        return None
    return (f"its checkpoints {checkpoint_dir} are gone (moved or deleted since its round {run.round}): put them back "
            "where they were (starting it afresh would train its rounds again from the initial model)")


def json_ready(row: dict) -> dict:
    """A metrics row as JSON holds it (numpy scalars as numbers)."""
    return json.loads(json.dumps(row, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def run_service(args: argparse.Namespace, plan: Callable, launch_ranks: Callable[[], int] | None = None,
                rank_group=None) -> int:
    """``fedpar serve --state PATH``: serve runs until SIGTERM or SIGINT (``plan``: serve's, builds a run's
    coordinator parts from its options). ``launch_ranks``: once the state file and the certificates are checked
    (and the state file locked), start the aggregator ranks, rank 0 of which serves, and return their exit code;
    ``rank_group``: rank 0's ServiceRanks (cli/serve_ranks.py)."""
    from fedpar.cli.tlsopts import server_security
    from fedpar.security.tls import server_credentials, server_tls_files
    from fedpar.server.agent_port import BindError
    from fedpar.server.run_control import RunControlServer

    state = Path(args.state)
    lock = None
    try:  # the flags and ports first: a start refused for them leaves no state file, nor a lock file
        check_state_folder(state)  # a mistyped --state is refused, not made
        _check_one_shot_outputs(args)
        if args.tensorboard:  # each run writes under it: a folder no run can use is said at start
            check_tensorboard_folder(args.tensorboard)
        check_distinct_ports(args)
        if args.insecure and not (args.certs or args.tls_ca):
            raise UserError("the control port of 'fedpar serve --state' needs mutual TLS even with --insecure (its "
                            "certificates say who may submit and stop runs): make them with 'fedpar certs --out certs "
                            "--agents ID1,ID2 --operators NAME' and pass '--certs certs'")
        if launch_ranks is None:  # said before gRPC tries them (its own log line says it too, unasked)
            check_port_free(args.host, args.port)
            check_port_free(args.host, args.control_port, "--control-port")
            check_metrics_endpoint(args)
        else:  # before any rank starts: a rank that cannot bind its port would be restarted in vain
            check_metrics_endpoint(args)
            check_rank_ports(args.host, args.port, args.aggregator_ranks, {p: o for p, o in (
                (args.control_port, "--control-port"), (args.metrics_port, "--metrics-port")) if p})
            from fedpar.server.ranks.memory import check_aggregator_ranks_fit
            check_aggregator_ranks_fit(args.aggregator_ranks)  # each run's model is built as it starts: not known
        lock = None if getattr(args, "state_lock_held", False) else _lock(state)  # held by the ranks' launcher
        revocations = server_security(args).admission.revocations  # the control API's too: operators are revoked
        files = server_tls_files(args.certs, args.tls_cert, args.tls_key, args.tls_ca)
        if files.ca is None:
            raise UserError("the control port needs mutual TLS: give --certs DIR (or --tls-ca)")
        credentials = server_credentials(files)
    except (ValueError, UserError, StoreError) as exc:
        print(f"fedpar serve: {exc}", file=sys.stderr)
        if lock is not None:
            lock.release(refused=True)
        return exc.exit_code if isinstance(exc, UserError) else 2
    refusal = None if Path(state).exists() else foreign_runs(state, set())  # before a refused start makes the file
    store = None
    if refusal is None:
        try:
            store = RunStore(state)
            refusal = foreign_runs(state, {run.id for run in store.runs()})
        except StoreError as exc:
            refusal = str(exc)
    if refusal is not None:
        if store is not None:
            store.close()
        print(f"fedpar serve: {refusal}", file=sys.stderr)
        if lock is not None:
            lock.release(refused=True)
        return 2
    if launch_ranks is not None:
        store.close()
        try:
            return launch_ranks()
        finally:
            lock.release(refused=False)
    for run_id in store.recover():
        _say_at_start(store, run_id, "was running when the service last ended: it resumes from its last checkpoint")
    for run_id in store.retry():
        _say_at_start(store, run_id, "could not resume when the service last ran: it tries again from its last "
                                     "checkpoint")
    service, control = RunService(args, store, args.port, plan, rank_group), None
    try:  # a signal at any moment, the first second's included, stops the service cleanly
        with stop_on_signals(second_exits=rank_group is None) as received:  # a rank's launcher escalates
            if rank_group is not None:
                rank_group.signalled = lambda: received.signal is not None
            try:
                port = service.open_agents_port()
            except BindError as exc:
                print(f"fedpar serve: {exc}; try another --port (0 picks a free one)", file=sys.stderr)
                return 2  # taken since the check above: a port in use, as check_port_free says it
            try:
                service.observers.attach_service(service.idle)  # from the start: an idle service is no missing target
            except UserError as exc:  # taken since the check above
                print(f"fedpar serve: {exc}", file=sys.stderr)
                return exc.exit_code
            try:
                control = RunControlServer(store, service.validate, args.host, args.control_port, credentials,
                                           revocations)
            except OSError as exc:  # taken since the check above
                print(f"fedpar serve: {exc}", file=sys.stderr)
                return 2
            if args.port_file:  # first: a script that sees the control port file finds both
                atomic_write_bytes(args.port_file, [f"{port}\n".encode()])
            if args.control_port_file:
                atomic_write_bytes(args.control_port_file, [f"{control.port}\n".encode()])
            print(f"fedpar service: agents on {args.host}:{port}, control API on {args.host}:{control.port} (mutual "
                  f"TLS, operators only), runs in {state}", flush=True)
            service.serve_forever()
    except KeyboardInterrupt as exc:
        if not getattr(args, "launcher_says_stopped", False):  # else its launcher names the signal the user sent
            print(f"fedpar service: stopped by {signal_name(exc)}", flush=True)
        return 0
    except StoreError as exc:  # e.g. locked by another writer for longer than the busy timeout: nothing is lost
        print(f"fedpar serve: {exc}; a run left running resumes at the next start", file=sys.stderr)
        return 1
    finally:
        if control is not None:
            control.stop()
        service.close_agents_port()
        service.observers.close()
        store.close()
        if lock is not None:
            lock.release(refused=False)
    return 0


def _say_at_start(store: RunStore, run_id: int, what: str) -> None:
    """Say in run ``run_id``'s log and on stdout ``what`` the service's start does with it."""
    line = f"run {run_id} {what}"
    store.log(run_id, line)
    print(line, flush=True)


def until_told(coordinator) -> None:
    """After the last round, before ``coordinator`` stops: let its agents hear "shutdown" on their next call. A live
    agent calls at least once a heartbeat (its long-poll returns by then); one that misses it would retry a
    coordinator that is gone, until its --give-up-after (2 s was too short on a busy machine)."""
    linger_until = time.monotonic() + coordinator.config.heartbeat_seconds
    while not coordinator.everyone_told_finished() and time.monotonic() < linger_until:
        time.sleep(0.05)
