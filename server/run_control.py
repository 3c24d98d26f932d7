"""The control API of a long-lived coordinator service: submit, list, follow, stop and download runs, on a port of
its own, over mutual TLS, answered only for certificates with the operator role; every action is audited."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Callable, Iterator

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol import fedpar_pb2_grpc as pb_grpc
from fedpar.protocol.codec import grpc_target
from fedpar.security.admission import RevocationList, peer_identity
from fedpar.security.certs import OPERATOR_ROLE
from fedpar.server.run_store import ENDED, RunStore, StoreError, UnknownRun

log = logging.getLogger("fedpar.server")
FILE_CHUNK_BYTES = 1 << 20
MODEL_FILE = "global.safetensors"  # what a run that completed a round leaves
RUN_FILES = (MODEL_FILE, "global.json", "metrics.jsonl", "metrics.csv", "summary.json")
FOLLOW_POLL_SECONDS = 0.25
CONTROL_THREADS = 16
# follows (`run logs -f`) and downloads at once: each holds a thread while it lasts, and the others must stay free to
# answer submit, ls and stop
LONG_CALLS = CONTROL_THREADS - 4
LIST_REPLY_BYTES = 1 << 20  # the runs one List reply holds (a gRPC client takes 4 MiB by default): more are paged
NAME_CHARS = 100  # a run's name: a label for 'fedpar run ls', not a document
# what a follow hears when the service stops under it (UNAVAILABLE); 'fedpar run' says it in its own words
SERVICE_STOPPING = "the service is stopping"

# settings (JSON-ready dict) -> (the settings to store, a warning for the operator or ""); ValueError saying what is
# wrong.
Validate = Callable[[dict], tuple[dict, str]]


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def operator_of(context: grpc.ServicerContext, revocations: RevocationList | None = None) -> str:
    """The operator behind a call: its certificate's common name; _Refused unless the certificate has the
    operator role and neither the name nor the certificate's serial is on ``revocations`` (re-read when changed)."""
    peer = peer_identity(context)
    if peer is None:
        raise _Refused(grpc.StatusCode.UNAUTHENTICATED, "the control API needs a client certificate")
    if peer.role != OPERATOR_ROLE:
        raise _Refused(grpc.StatusCode.PERMISSION_DENIED, f"certificate {peer.common_name!r} has no operator role; "
                                                          "issue one with 'fedpar certs --operators NAME'")
    if revocations is not None:
        revocations.refresh()
        if revocations.is_revoked(peer.common_name, peer.serial):
            raise _Refused(grpc.StatusCode.PERMISSION_DENIED, _revoked_line(peer, revocations))
    return peer.common_name


def _revoked_line(peer, revocations: RevocationList) -> str:
    """Why a revoked operator is refused, and what undoes it: a name revoked refuses a new certificate of it too."""
    name = peer.common_name
    if name in revocations.ids:
        return (f"operator {name!r} was revoked by name (in the service's {Path(revocations.path).name}), so a new "
                f"certificate of that name is refused too; ask the service's operator to remove {name!r} there, or "
                "for a certificate under another name ('fedpar certs --operators NAME')")
    return (f"the certificate (serial {peer.serial:x}) of operator {name!r} was revoked; ask the service's operator "
            f"for a new one ('fedpar certs --operators {name} --force')")


def check_run_name(name: str) -> str:
    """``name`` if a run may be called so; ValueError saying what to change (control characters, or too long)."""
    if len(name) > NAME_CHARS:
        raise ValueError(f"a run's name has at most {NAME_CHARS} characters (this one has {len(name)}): give a "
                         "shorter --name")
    if not name.isprintable():
        raise ValueError(f"a run's name may not hold control or other unprintable characters ({printable(name)}): "
                         "give --name plain text")
    return name


def printable(text: str) -> str:
    """``text`` with each unprintable character (a newline, a terminal escape) escaped, as Python writes it: a name
    an older service stored is shown, never acted on by the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class RunControl(pb_grpc.RunControlServicer):
    """The RunControl calls on top of a :class:`RunStore`; ``validate`` checks a submitted run's settings;
    ``revocations``: the revocation list operators' certificates are checked against at every call."""

    def __init__(self, store: RunStore, validate: Validate, revocations: RevocationList | None = None):
        self.store, self.validate, self.revocations = store, validate, revocations
        self._long_calls = threading.BoundedSemaphore(LONG_CALLS)
        self.stopping = threading.Event()  # set before the service closes its store: follows end, not read it

    @contextlib.contextmanager
    def _long_call(self, context) -> Iterator[None]:
        """Hold one of the LONG_CALLS slots while a follow or a download lasts; RESOURCE_EXHAUSTED when none is
        free."""
        if not self._long_calls.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{LONG_CALLS} follows ('fedpar run logs -f') and downloads are under way on this service "
                          "already; end one of them, or leave out -f to see the log so far")
        try:
            yield
        finally:
            self._long_calls.release()

    def _operator(self, context, action: str, run_id: int | None = None) -> str:
        """The operator behind the call (:func:`operator_of`); a refusal is audited (with the run asked for) and
        ends the call in one line."""
        try:
            return operator_of(context, self.revocations)
        except _Refused as r:
            peer = (context.auth_context().get("x509_common_name") or [b"(no certificate)"])[0].decode()
            self.store.audit(peer, f"refused {action}", run_id, detail=r.message)
            context.abort(r.code, r.message)

    def _guard(self, context, action: str, fn, run_id: int | None = None):
        """``fn(who)`` for the operator behind the call; each refusal audited (with the run asked for) and said as a
        gRPC error of one line."""
        who = self._operator(context, action, run_id)
        try:
            return fn(who)
        except UnknownRun as exc:
            self.store.audit(who, action, run_id, detail=str(exc))
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except ValueError as exc:
            self.store.audit(who, f"refused {action}", run_id, detail=str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except StoreError as exc:
            context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug here: one line each side, not gRPC's traceback
            log.error("control call %s by %s failed: %s: %s", action, who, type(exc).__name__, exc)
            self.store.audit(who, f"failed {action}", run_id, detail=f"{type(exc).__name__}: {exc}")
            context.abort(grpc.StatusCode.INTERNAL, f"the service failed to {action}: {type(exc).__name__}: {exc}")

    def Submit(self, request: pb.RunSubmit, context) -> pb.RunRef:
        """Check and queue a run."""
        def submit(who):
            try:
                settings = json.loads(request.settings_json or "{}")
            except json.JSONDecodeError as exc:
                raise ValueError(f"run settings are not JSON: {exc}") from None
            if not isinstance(settings, dict):
                raise ValueError("run settings must be a table of settings")
            check_run_name(request.name)  # another client than 'fedpar run' may send any text
            checked, warning = self.validate(settings)
            return pb.RunRef(run_id=self.store.submit(request.name or "run", checked, who, reason=warning),
                             warning=warning)
        return self._guard(context, "submit", submit)

    def List(self, request: pb.RunQuery, context) -> pb.RunList:
        """The runs after ``request.after_id``, oldest first, up to LIST_REPLY_BYTES of them (``more``: there are
        others; 'fedpar run ls' asks until it has every run)."""
        def listing(who):
            if request.after_id == 0:
                self.store.audit(who, "ls")  # once a listing, not once a page
            runs, size, more = [], 0, False
            for run in self.store.runs(request.after_id):
                text = json.dumps(run.to_json())
                if runs and size + len(text) > LIST_REPLY_BYTES:
                    more = True
                    break
                runs.append(text)
                size += len(text) + 2
            return pb.RunList(runs_json=f"[{', '.join(runs)}]", more=more)
        return self._guard(context, "ls", listing)

    def Stop(self, request: pb.RunRef, context) -> pb.RunList:
        """Ask a run to stop."""
        return self._guard(context, "stop", lambda who: pb.RunList(
            runs_json=json.dumps([self.store.request_stop(request.run_id, who).to_json()])), request.run_id)

    def Logs(self, request: pb.RunLogsRequest, context):
        """A run's log lines and rounds; with ``follow``, until it ends (or the caller leaves)."""
        def first(who):
            self.store.audit(who, "logs", request.run_id)
            return self.store.get(request.run_id)
        run = self._guard(context, "logs", first, request.run_id)
        with self._long_call(context) if request.follow else contextlib.nullcontext():
            yield from self._timeline(run, request, context)

    def _timeline(self, run, request: pb.RunLogsRequest, context):
        """The rounds and log lines of ``run`` after the request's, as Logs sends them; with ``follow``, until it
        ends (or the caller leaves)."""
        after, after_line = request.after_round, 0
        while True:
            ended = run.status in ENDED  # read before the rows: a run that ended has written all of them
            for kind, key, entry in self._read(context, self.store.timeline, run.id, after_line, after):
                if kind == "line":
                    after_line = key
                    yield pb.RunRound(line=entry, status=run.status)
                else:
                    after = key
                    yield pb.RunRound(metrics_json=json.dumps(entry), status=run.status)
            if not request.follow or ended or not context.is_active():
                yield pb.RunRound(status=run.status)
                return
            time.sleep(FOLLOW_POLL_SECONDS)
            self._operator(context, "logs", run.id)  # revoked meanwhile: the follow ends as their next call would
            run = self._read(context, self.store.get, run.id)

    def _read(self, context, fn, *args):
        """``fn(*args)``, a read of the store by a follow; once the service stops (its store closing or closed), the
        follow ends with UNAVAILABLE saying so, not with gRPC's traceback of the closed database."""
        if not self.stopping.is_set():
            try:
                return fn(*args)
            except StoreError as exc:
                if not self.stopping.is_set():
                    context.abort(grpc.StatusCode.INTERNAL, str(exc))
        context.abort(grpc.StatusCode.UNAVAILABLE, SERVICE_STOPPING)

    def Get(self, request: pb.RunRef, context):
        """A run's final model and metrics files."""
        def files(who):
            run = self.store.get(request.run_id)
            if run.status not in ENDED:
                raise ValueError(f"run {run.id} is {run.status}; its model is downloadable once it ends")
            # a run that never started has no folder: Path("") would be the service's working directory
            if run.out_dir and not Path(run.out_dir).is_dir():
                raise ValueError(f"run {run.id} is {run.status}, but its outputs folder {run.out_dir} is gone from "
                                 "the service's machine (moved or deleted there): nothing is left to get")
            found = [p for p in (Path(run.out_dir) / name for name in RUN_FILES) if p.is_file()] if run.out_dir else []
            if not found:
                raise ValueError(f"run {run.id} is {run.status} with no model or metrics to get"
                                 + (f" ({run.reason})" if run.reason else ""))
            self.store.audit(who, "get", run.id)
            return found
        found = self._guard(context, "get", files, request.run_id)
        with self._long_call(context):
            for path in found:
                with path.open("rb") as fh:
                    while chunk := fh.read(FILE_CHUNK_BYTES):
                        yield pb.RunFile(name=path.name, data=chunk)


class RunControlServer:
    """The control API served on ``host:port`` (0 picks a free one) with ``credentials`` (mutual TLS), refusing
    the certificates on ``revocations``."""

    def __init__(self, store: RunStore, validate: Validate, host: str, port: int,
                 credentials: grpc.ServerCredentials, revocations: RevocationList | None = None):
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=CONTROL_THREADS,
                                                              thread_name_prefix="fedpar-control"),
                                   options=[("grpc.so_reuseport", 0)])
        self.servicer = RunControl(store, validate, revocations)
        pb_grpc.add_RunControlServicer_to_server(self.servicer, self._server)
        try:
            self.port = self._server.add_secure_port(grpc_target(host, port), credentials)
        except RuntimeError:
            raise OSError(f"cannot listen on {host}:{port} for the control API: the port is in use or the "
                          "address is not this machine's") from None
        self._server.start()

    def stop(self, grace: float = 1.0) -> None:
        """Stop answering control calls: follows under way end first, saying the service stops."""
        self.servicer.stopping.set()
        self._server.stop(grace).wait(grace + 1)
