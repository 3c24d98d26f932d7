"""fedpar's implementation of Flower's ``Grid`` (flwr.serverapp.Grid): a Flower App's ServerApp runs unchanged on a
fedpar coordinator. Node ids are fedpar clients (protocol/flower_nodes.py ``node_id_of``); ``push_messages`` opens a
coordinator round carrying the Messages (server/flower_rounds.py), ``pull_messages`` takes the replies that arrived,
``send_and_receive`` waits for the round to close (every node answered, or the timeout / deadline passed).

Every method runs on the ServerApp's thread and reaches the coordinator's event loop through
``asyncio.run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedpar.protocol.flower_nodes import SERVER_NODE_ID
from fedpar.protocol.flower_wire import encode_message
from fedpar.server.flower_rounds import FlowerCoordinator, agents_by_node, error_reply, sent_model
from fedpar.task import TaskFailed, raised

FLOWER_RUN_ID = 1  # the run's id in Flower's metadata (one run per coordinator)
log = logging.getLogger("fedpar.server")
_capture_lock = threading.Lock()


class NodesWillNotCome(TaskFailed):
    """The ServerApp waits for more nodes than the run will have (said in one line, as a task's failure is)."""


class ServerAppFailed(TaskFailed):
    """The Flower App's ServerApp raised: the run stops, its one line names what the app raised."""


NOTHING_SENT = ("the ServerApp's main returned without sending a Message, so no round ran and there is no model: "
                "its main must send them, e.g. FedAvg(...).start(grid=grid, initial_arrays=..., num_rounds=N) with N "
                "at least 1 (check the run config's num-server-rounds): fix the app")


class CoordinatorGrid(Grid):
    """A Flower Grid whose nodes are ``coordinator``'s live members and whose messages travel as its rounds."""

    def __init__(self, coordinator: FlowerCoordinator, loop: asyncio.AbstractEventLoop, patience: float = 300.0):
        self.coordinator, self.loop, self.patience = coordinator, loop, patience
        self._asking: tuple[float, int] | None = None  # since when the ServerApp asks for nodes, and how many there are
        self._run = Run.create_empty(FLOWER_RUN_ID)
        self._rounds: list[tuple[set[str], Future]] = []  # pushed rounds: their message ids, their replies
        self._lock = threading.Lock()
        self.sent_any = False  # whether the ServerApp sent a Message at all (one that runs no round is a mistake)
        self._training = TrainingReplies()

    # ----------------------------------------------------------------- run
    def set_run(self, run: Run) -> None:
        """Set the run this Grid operates in."""
        if not isinstance(run, Run):
            raise TypeError(f"`run` must be an instance of Run, got {type(run).__name__}")
        self._run = run

    @property
    def run(self) -> Run:
        """Run information (a copy)."""
        return Run(**vars(self._run))

    # ----------------------------------------------------------------- messages
    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        """A new Message to ``dst_node_id`` (Flower deprecates this for the Message constructor; kept faithful)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """The node ids of the coordinator's live members. A ServerApp that keeps asking while no node joins (a
        strategy waiting for more nodes than will come) is stopped after ``patience`` seconds, in one line."""
        nodes = list(self._agents().keys())
        now = time.monotonic()
        if self._asking is None or self._asking[1] != len(nodes):
            self._asking = (now, len(nodes))
        elif now - self._asking[0] > self.patience:
            raise NodesWillNotCome(
                f"the ServerApp waited {self.patience:.0f} s for more than the {len(nodes)} nodes it has (its "
                "strategy's min_available_nodes, min_train_nodes or min_evaluate_nodes); start more clients "
                "(--clients, or more fedpar client agents) or lower those in the app")
        return nodes

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Send each message to its ``dst_node_id`` as one coordinator round (after any round still open); their
        ids. A message to a node that is not a live member gets an error reply at once."""
        return self._push(messages, None)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` that have arrived (each handed out once)."""
        wanted, out = set(message_ids), []
        with self._lock:
            for ids, future in list(self._rounds):
                if not future.done() or not ids & wanted:
                    continue
                replies = [r for r in future.result() if r.metadata.reply_to_message_id in wanted]
                self._training.received(replies)
                out += replies
                taken = {r.metadata.reply_to_message_id for r in replies}
                ids -= taken
                if not ids:
                    self._rounds.remove((ids, future))
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages`` and wait for the replies: all of them, or those in before ``timeout`` seconds (the
        coordinator's --deadline-seconds caps it)."""
        ids = self._push(messages, timeout)
        if not ids:
            return []
        with self._lock:
            future = self._rounds[-1][1]
        future.result()
        return self.pull_messages(ids)

    def untrained(self) -> str | None:
        """Why no train Message the ServerApp sent got a reply with content (None: one did, or it sent none)."""
        return self._training.failure()

    # ----------------------------------------------------------------- helpers
    def _agents(self) -> dict[int, str]:
        return agents_by_node(self._on_loop(self._live()))

    async def _live(self) -> list[str]:
        return self.coordinator.node_agents()

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _push(self, messages: Iterable[Message], timeout: float | None) -> list[str]:
        self._asking = None
        agents = self._agents()
        outgoing: dict[str, tuple[bytes, Message]] = {}
        refused: list[Message] = []
        message_type, flower_round = "", 0
        for message in messages:
            self.sent_any = True
            self._training.sent(message)
            meta = message.metadata
            meta.__dict__["_message_id"] = str(uuid.uuid4())  # as Flower's grids do
            meta.delivered_at = ""
            message_type = meta.message_type
            flower_round = server_round(message)
            agent = agents.get(meta.dst_node_id)
            if agent is None or agent in outgoing:
                why = "is not a live fedpar client" if agent is None else "already has a message in this round"
                refused.append(error_reply(message, f"node {meta.dst_node_id} {why}"))
                continue
            if message.has_content() and len(message.content.array_records) == 1:
                self.coordinator.sent_arrays = next(iter(message.content.array_records.values()))
            data = encode_message(message)
            limit = self.coordinator.config.max_chunk_bytes
            if len(data) > limit:  # a task travels as one gRPC message
                log.error("a Flower message of %d bytes is over --max-chunk-bytes %d; raise it (at most 64 MiB)",
                          len(data), limit)
                refused.append(error_reply(message, f"message of {len(data)} bytes is over --max-chunk-bytes {limit}"))
                continue
            outgoing[agent] = (data, message)
        future = asyncio.run_coroutine_threadsafe(
            self.coordinator.exchange(outgoing, timeout, message_type, flower_round), self.loop)
        ids = {m.metadata.message_id for _, m in outgoing.values()} | \
              {r.metadata.reply_to_message_id for r in refused}
        if not ids:
            return []
        done: Future = Future()
        future.add_done_callback(lambda f: _settle(done, f, refused))
        with self._lock:
            self._rounds.append((set(ids), done))
        return list(ids)


class TrainingReplies:
    """Whether the ServerApp's train Messages got any reply with content, and the first error reply's reason."""

    def __init__(self) -> None:
        self.asked = self.answered = False
        self.first_error: str | None = None

    def sent(self, message: Message) -> None:
        """Note a Message the ServerApp sends."""
        self.asked |= message.metadata.message_type == MessageType.TRAIN

    def received(self, replies: Iterable[Message]) -> None:
        """Note the replies handed to the ServerApp."""
        for reply in replies:
            if reply.metadata.message_type != MessageType.TRAIN:
                continue
            if reply.has_error():
                self.first_error = self.first_error or reply.error.reason
            else:
                self.answered = True

    def failure(self) -> str | None:
        """One line saying that nothing was trained, and why; None when a train reply had content."""
        if not self.asked or self.answered:
            return None
        why = f"every reply was an error, e.g. {self.first_error}: fix the app" if self.first_error else \
            ("no node replied before the round's deadline (the Grid's timeout, capped by --deadline): give it more "
             "time, or make the ClientApp faster")
        return f"no node answered the ServerApp's train messages with a model, so nothing was trained: {why}"


def server_round(message: Message) -> int:
    """The strategy's round a message belongs to: its config's ``server-round`` (as Flower's strategies set it), else
    a numeric ``group_id``, else 0."""
    if message.has_content():
        for record in message.content.config_records.values():
            value = record.get("server-round")
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    group = message.metadata.group_id
    return int(group) if group.isdigit() else 0


def _settle(done: Future, exchange: Future, refused: list[Message]) -> None:
    """The round's replies (and the error replies made before it) once it closed; cancelled with it (the coordinator
    stopped), which ends a ServerApp waiting for them."""
    if exchange.cancelled():
        done.cancel()
    elif exchange.exception() is not None:
        done.set_exception(exchange.exception())
    else:
        done.set_result(refused + list(exchange.result().values()))


def server_app_main(server_app: ServerApp, run_config: dict, patience: float = 300.0):
    """The coordinator's ``app_main`` (server/flower_rounds.py) for ``server_app``: its ``main(grid, context)`` run
    as Flower's own runtime runs it (server/run_serverapp.py: the task identity of the SuperLink's side, a Context
    with the run config), on a :class:`CoordinatorGrid` (``patience``: seconds it may wait for nodes that do not
    come). It returns the final arrays, by name (the Result of the
    strategy's ``start``, else the last global model a message carried), and summary.json's "flower" entry."""

    def main(coordinator: FlowerCoordinator):
        grid = CoordinatorGrid(coordinator, coordinator.loop, patience)
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, FLOWER_RUN_ID, SERVER_NODE_ID
        context = Context(run_id=FLOWER_RUN_ID, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(),
                          run_config=dict(run_config))
        with strategy_results() as results, _flower_lines_once():
            try:
                server_app(grid=grid, context=context)
            except NodesWillNotCome:
                raise
            except Exception as exc:  # the app's own code (or Flower's strategy in it): its words, in one line
                raise ServerAppFailed(f"the ServerApp failed: {raised(exc)}: fix the app") from exc
        if not grid.sent_any:
            raise ServerAppFailed(NOTHING_SENT)
        if grid.untrained():
            raise ServerAppFailed(grid.untrained())
        arrays = results[-1].arrays if results and len(results[-1].arrays) else coordinator.sent_arrays
        final = sent_model(arrays) if arrays is not None and len(arrays) else None
        return final, result_summary(results[-1]) if results else {}

    return main


@contextlib.contextmanager
def _flower_lines_once():
    """Flower's log lines (its strategy's rounds) printed once, by Flower's own handler, for the span: they went on
    to the root logger too, whose handler a fedpar command sets up, and showed twice."""
    flower_log = logging.getLogger("flwr")
    propagate, flower_log.propagate = flower_log.propagate, False
    try:
        yield
    finally:
        flower_log.propagate = propagate


@contextlib.contextmanager
def strategy_results():
    """The Results every ``flwr.serverapp.strategy`` Strategy's ``start`` returns while inside (a ServerApp's main
    returns nothing: its Result is its strategy's)."""
    results: list[Result] = []
    with _capture_lock:
        original = Strategy.start

        def start(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            results.append(result)
            return result

        Strategy.start = start
        try:
            yield results
        finally:
            Strategy.start = original


def result_summary(result: Result) -> dict:
    """A Flower Result's metrics by round, as JSON (summary.json's "flower")."""
    def rounds(by_round: dict) -> dict:
        return {str(r): {k: float(v) if isinstance(v, (int, float)) else v for k, v in dict(m).items()}
                for r, m in by_round.items()}
    return {"train_metrics_clientapp": rounds(result.train_metrics_clientapp),
            "evaluate_metrics_clientapp": rounds(result.evaluate_metrics_clientapp),
            "evaluate_metrics_serverapp": rounds(result.evaluate_metrics_serverapp)}
