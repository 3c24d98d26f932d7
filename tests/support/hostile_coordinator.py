"""A stand-in coordinator whose every reply the test chooses: a real gRPC server on 127.0.0.1 port 0 speaking the
Coordinator service (protocol/fedpar.proto) to a real agent, replies given as messages or as raw bytes."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from typing import Callable

import grpc
import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import SERVICE_NAME, ModelLayout, build_payload, channel_options, layout_to_pb

Reply = pb.PullTaskReply | bytes


def _raw(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class HostileCoordinator:
    """Answers Join with ``join_reply``, each PullTask with the next of ``tasks`` (then wait, or ``after``), downloads
    with ``download(request)`` (an iterable of ModelChunk or raw bytes), and records every upload and pull."""

    def __init__(self, tasks: list[Reply] | None = None, after: Reply | None = None,
                 join_reply: pb.JoinReply | bytes | None = None,
                 download: Callable[[pb.DownloadRequest], object] | None = None):
        self.replies: queue.Queue = queue.Queue()
        for reply in tasks or []:
            self.replies.put(reply)
        self.after = after if after is not None else pb.PullTaskReply(shutdown_reason="done")
        self.join_reply = join_reply if join_reply is not None else pb.JoinReply(token="t", heartbeat_seconds=5,
                                                                                 max_chunk_bytes=1 << 20)
        self.download = download or (lambda request: iter(()))
        self.pulls: list[pb.PullTaskRequest] = []
        self.uploads: list[object] = []
        self.joins = 0
        self.heartbeats = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(8), options=channel_options(64 << 20))
        handlers = {
            "Join": grpc.unary_unary_rpc_method_handler(self._join, pb.JoinRequest.FromString, _raw),
            "PullTask": grpc.unary_unary_rpc_method_handler(self._pull, pb.PullTaskRequest.FromString, _raw),
            "DownloadWeights": grpc.unary_stream_rpc_method_handler(self._download, pb.DownloadRequest.FromString,
                                                                    _raw),
            "UploadSmall": grpc.unary_unary_rpc_method_handler(self._upload_small, pb.SmallUpload.FromString, _raw),
            "UploadUpdate": grpc.stream_unary_rpc_method_handler(self._upload, pb.UploadChunk.FromString, _raw),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self._heartbeat, pb.HeartbeatRequest.FromString, _raw),
            "Leave": grpc.unary_unary_rpc_method_handler(lambda r, c: pb.LeaveReply(), pb.LeaveRequest.FromString,
                                                         _raw),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()
        self.finished = threading.Event()  # set when a pull after the scripted replies came

    def _join(self, request, context):
        self.joins += 1
        return self.join_reply

    def _pull(self, request, context):
        self.pulls.append(request)
        try:
            return self.replies.get_nowait()
        except queue.Empty:
            self.finished.set()
            return self.after

    def _heartbeat(self, request, context):
        self.heartbeats += 1
        return pb.HeartbeatReply()

    def _download(self, request, context):
        yield from self.download(request)

    def _upload_small(self, request, context):
        self.uploads.append(request)
        return pb.UploadReply(accepted=True)

    def _upload(self, request_iterator, context):
        context.send_initial_metadata((("fedpar-upload", "admitted"),))
        self.uploads.append(list(request_iterator))
        return pb.UploadReply(accepted=True)

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop(0)


def digits_layout() -> ModelLayout:
    """The layout of the agent's model in `fedpar client --dataset digits` (the default mlp)."""
    from fedpar.datasets import load_dataset
    from fedpar.models.for_data import build_model_for_data

    splits = load_dataset("digits")
    model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
    return ModelLayout((name, t.detach().numpy().dtype.name, tuple(t.shape)) for name, t in model.state_dict().items()
                       if t.is_floating_point())


def weights_of(layout: ModelLayout, value: float = 0.0) -> list[np.ndarray]:
    """Arrays filling ``layout`` with ``value``."""
    return [np.full(t.shape, value, dtype=t.dtype) for t in layout.tensors]


def inline_task(layout: ModelLayout, arrays: list[np.ndarray], round_id: int = 1, task_id: str = "t1",
                **fields) -> pb.PullTaskReply:
    """A task carrying its weights inside (a small model's)."""
    task = pb.TrainTask(round=round_id, task_id=task_id, deadline_seconds=fields.pop("deadline_seconds", 30.0),
                        local_epochs=fields.pop("local_epochs", 1), batch_size=fields.pop("batch_size", 16),
                        learning_rate=fields.pop("learning_rate", 0.1), **fields)
    task.weights_header.CopyFrom(pb.ModelHeader(round=round_id, tensors=layout_to_pb(layout),
                                                total_bytes=layout.total_bytes))
    task.weights = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    return pb.PullTaskReply(task=task)


def streamed(layout: ModelLayout, arrays: list[np.ndarray], chunk_bytes: int = 1 << 16) -> list[bytes]:
    """The DownloadWeights messages of ``arrays`` (header, then data chunks), serialized."""
    return list(build_payload(1, layout, arrays, chunk_bytes).messages())


def run_agent(coordinator: HostileCoordinator, cwd, seconds: float = 30.0, interrupt_after: float | None = None,
              capfd=None, more: tuple[str, ...] = ()) -> tuple[int, str]:
    """A real `fedpar client --dataset digits` against ``coordinator`` until it exits (Ctrl-C after
    ``interrupt_after`` seconds, or after ``seconds``): its exit code and what it printed (stdout and stderr).
    Given ``capfd`` and no interrupt, the client's main runs in this process (support.in_process.run_main: the same
    code, gRPC calls and exit code, without a process's start-up; its stdout, then its stderr, whose last line is
    its last word); a hang is the test's timeout. ``more``: the agent's further options."""
    argv = ["client", "--insecure", "--server", coordinator.address, "--agent-id", "a", "--dataset", "digits",
            "--poll", "1", "--max-backoff", "0.5", "--threads", "1",
            "--device", "cpu", *more]  # on a GPU box CUDA's start-up took the seconds these tests give the agent
    if capfd is not None and interrupt_after is None:
        from support.in_process import run_main

        done = run_main(argv, capfd, cwd)
        return done.returncode, done.stdout + done.stderr
    command = [sys.executable, "-m", "fedpar", *argv]
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    try:
        out, _ = agent.communicate(timeout=interrupt_after or seconds)
    except subprocess.TimeoutExpired:
        agent.send_signal(signal.SIGINT)
        out, _ = agent.communicate(timeout=30)
    return agent.returncode, out


def run_agents_interrupted(coordinators: list[HostileCoordinator], cwd, after_join: float = 4.0,
                           seconds: float = 60.0) -> list[tuple[int, str]]:
    """A real `fedpar client --dataset digits` process against each of ``coordinators``, side by side, each sent
    Ctrl-C (SIGINT) ``after_join`` seconds after its coordinator first heard it (a Join or a PullTask: the agent's
    start-up, slower on a loaded machine, is not counted): each one's exit code and what it printed."""
    argv = ["client", "--insecure", "--agent-id", "a", "--dataset", "digits", "--poll", "1", "--max-backoff", "0.5",
            "--threads", "1", "--device", "cpu"]
    agents = [subprocess.Popen([sys.executable, "-m", "fedpar", *argv, "--server", c.address], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=cwd) for c in coordinators]
    try:
        heard: dict[int, float] = {}
        end = time.monotonic() + seconds
        while len(heard) < len(agents) and time.monotonic() < end:
            for i, (agent, coordinator) in enumerate(zip(agents, coordinators)):
                if i not in heard and (coordinator.joins or coordinator.pulls or agent.poll() is not None):
                    heard[i] = time.monotonic()
            time.sleep(0.05)
        for i in sorted(heard, key=heard.get):
            time.sleep(max(0.0, heard[i] + after_join - time.monotonic()))
            if agents[i].poll() is None:
                agents[i].send_signal(signal.SIGINT)
        return [(agent.wait(30), agent.communicate()[0]) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()


HostReply = pb.PullHostTasksReply | bytes


class HostileHostCoordinator:
    """A coordinator for a population's host: answers JoinPopulation with ``join_reply``, each PullHostTasksRequest on
    the host's task stream with the next of ``tasks`` (then ``after``), each HostUploads with ``upload_reply(request)``
    (default: every update and partial accepted), downloads with ``download(request)``; records every join, pull and
    upload batch. Without ``after``, a pull past the script long-polls: it says shutdown once ``done_when(self)``
    holds (by default at once), else answers empty after the pull's wait."""

    def __init__(self, tasks: list[HostReply] | None = None, after: HostReply | None = None,
                 done_when: Callable[[HostileHostCoordinator], bool] = lambda coordinator: True,
                 join_reply: pb.JoinPopulationReply | bytes | None = None,
                 upload_reply: Callable[[pb.HostUploads], object] | None = None,
                 download: Callable[[pb.DownloadRequest], object] | None = None):
        self.replies: queue.Queue = queue.Queue()
        for reply in tasks or []:
            self.replies.put(reply)
        self.after, self.done_when = after, done_when
        self.join_reply = join_reply if join_reply is not None else pb.JoinPopulationReply(
            host_token="h", heartbeat_seconds=5, max_chunk_bytes=1 << 20)
        self.upload_reply = upload_reply or accept_all
        self.download = download or (lambda request: iter(()))
        self.joins: list[pb.JoinPopulationRequest] = []
        self.pulls: list[pb.PullHostTasksRequest] = []
        self.uploads: list[pb.HostUploads] = []
        self.finished = threading.Event()  # set when a pull after the scripted replies came
        self.server = grpc.server(futures.ThreadPoolExecutor(8), options=channel_options(64 << 20))
        handlers = {
            "JoinPopulation": grpc.unary_unary_rpc_method_handler(self._join, pb.JoinPopulationRequest.FromString,
                                                                  _raw),
            "HostTaskStream": grpc.stream_stream_rpc_method_handler(self._tasks, pb.PullHostTasksRequest.FromString,
                                                                    _raw),
            "HostUploadStream": grpc.stream_stream_rpc_method_handler(self._uploads, pb.HostUploads.FromString, _raw),
            "DownloadWeights": grpc.unary_stream_rpc_method_handler(
                lambda request, context: iter(self.download(request)), pb.DownloadRequest.FromString, _raw),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def _join(self, request, context):
        self.joins.append(request)
        return self.join_reply

    def _tasks(self, requests, context):
        for request in requests:
            self.pulls.append(request)
            yield self.next_reply(request)

    def next_reply(self, request: pb.PullHostTasksRequest) -> HostReply:
        """The reply to one pull: the next scripted one, then ``after``."""
        try:
            return self.replies.get_nowait()
        except queue.Empty:
            self.finished.set()
        if self.after is not None:
            return self.after
        until = time.monotonic() + request.wait_seconds
        while not self.done_when(self):
            if time.monotonic() > until:
                return pb.PullHostTasksReply()
            time.sleep(0.02)
        return pb.PullHostTasksReply(shutdown_reason="done")

    def _uploads(self, requests, context):
        for request in requests:
            self.uploads.append(request)
            yield self.upload_reply(request)

    def uploaded(self) -> list[str]:
        """The members whose updates came, one by one or in partials."""
        return [u.header.auth.agent_id for batch in self.uploads for u in batch.uploads] + \
            [m for batch in self.uploads if batch.partial.member_ids for m in batch.partial.member_ids.split("\n")]

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop(0)


def accept_all(request: pb.HostUploads) -> pb.HostUploadResults:
    """Every update of the batch, and its partial, accepted."""
    return pb.HostUploadResults(results=[pb.HostUploadResult(accepted=True) for _ in request.uploads],
                                partial=pb.HostUploadResult(accepted=True))


def host_tasks(layout: ModelLayout, arrays: list[np.ndarray] | None, members: list[str], round_id: int = 1,
               **fields) -> pb.PullHostTasksReply:
    """A pull's reply handing ``members`` a task each of round ``round_id`` (``fields``: the TrainTask's), the round's
    weights ``arrays`` sent once for all of them (None: none sent)."""
    knobs = dict(deadline_seconds=30.0, local_epochs=1, batch_size=16, learning_rate=0.1, model_id=f"m{round_id}")
    knobs.update(fields)
    reply = pb.PullHostTasksReply(tasks=[pb.HostedTask(agent_id=m, task=pb.TrainTask(
        round=round_id, task_id=f"{m}-r{round_id}", **knobs)) for m in members])
    if arrays is not None:
        reply.weights_header.CopyFrom(pb.ModelHeader(round=round_id, tensors=layout_to_pb(layout),
                                                     total_bytes=layout.total_bytes))
        reply.weights = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    return reply


class HostRun:
    """A real population host (client/runtime.py hosting simulations/population.py's members of digits, iid)
    against ``coordinator``, in this process: :meth:`run` until it returns, raises or ``seconds`` pass; then
    ``error`` (what run raised), ``lines`` (what fedpar logged at info and above) and ``thread_errors`` (exceptions
    that ended any thread)."""

    def __init__(self, coordinator, clients: int = 4, seats: int = 2, poll_seconds: float = 1.0,
                 max_backoff: float = 0.5):
        import logging

        from fedpar.datasets import load_dataset
        from fedpar.datasets.members import member_source
        from fedpar.simulations.population import PopulationSlice, host_population
        from fedpar.task import Partition
        from fedpar.tasks.zoo import classifier_for

        splits = load_dataset("digits")
        population = PopulationSlice.of("host-0", np.arange(clients), member_source(splits, "iid", clients, 0).sizes,
                                        np.zeros(clients))
        self.runtime = host_population(coordinator.address, population, classifier_for("mlp", splits, "digits"),
                                       lambda n, member: Partition(n, clients, member, "iid", 0, 0.1), seed=0,
                                       seats=seats, poll_seconds=poll_seconds, max_backoff=max_backoff)
        self.layout = self.runtime.layout
        self.members = [self.runtime.members.member_id(i) for i in range(clients)]
        self.error: BaseException | None = None
        self.lines: list[str] = []
        self.thread_errors: list[BaseException] = []
        self._handler = logging.Handler(logging.INFO)
        self._handler.emit = lambda record: self.lines.append(self._handler.format(record))
        self._logging = logging

    def run(self, seconds: float = 15.0) -> HostRun:
        """Run the host to its end (stopped after ``seconds``); this HostRun."""
        fedpar_log = self._logging.getLogger("fedpar")
        level = fedpar_log.level
        fedpar_log.addHandler(self._handler)
        fedpar_log.setLevel(self._logging.INFO)
        hook = threading.excepthook
        threading.excepthook = lambda args: self.thread_errors.append(args.exc_value)

        def target():
            try:
                self.runtime.run()
            except BaseException as exc:  # noqa: BLE001 - what the host raised is the test's to judge
                self.error = exc

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        try:
            thread.join(seconds)
            if thread.is_alive():
                self.runtime.stop()
                thread.join(30)
        finally:
            threading.excepthook = hook
            fedpar_log.removeHandler(self._handler)
            fedpar_log.setLevel(level)
        return self

    @property
    def text(self) -> str:
        """Everything logged, one record a line (a record of several lines, a traceback say, is several)."""
        return "\n".join(self.lines)
