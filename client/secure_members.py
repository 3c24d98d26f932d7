"""The client side of SecAgg+ for a client runtime's members (client/runtime.py).

Every sampled member must advertise and share its keys while the key stages are open, and its unmasking waits
until the coordinator has closed the masking stage, i.e. for the whole cohort's uploads. A runtime trains only a
few members at once (its seats), so a seat cannot hold a member through those waits: each member's key exchange
starts when its task reaches the runtime, and its unmasking runs after its masked upload, each in a thread of that
member's own (one per member sampled in a secure round, never one per client). The seat that trains the member
uses the same session (client/secure_upload.SecureUpload) for the masked upload in between. A runtime hosting one
member (a deployed agent) does the same: its key exchange overlaps its download and training, and its masked
upload waits for the exchange to end.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from fedpar.client.secure_upload import SecureUpload
from fedpar.client.transfer import NoteRefusal
from fedpar.client.secure_upload import SecureSession
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CoordinatorStub, ModelLayout



class HostedSecureUpload(SecureUpload):
    """A member's SecureUpload whose key exchange runs from the task's arrival on, beside its download and training
    (:meth:`upload` waits for it), and whose unmasking (:meth:`close`) runs in the background."""

    def start_keys(self) -> None:
        """Start stages 0-2 in a thread of their own."""
        self._keys = _in_thread(super().begin, f"secagg-keys-{self.session.auth.agent_id}")

    def begin(self) -> bool:
        """False if the key exchange was refused already (noted): then the member does not train; else True at once,
        as the exchange waits for the whole cohort (up to --secagg-stage-seconds when one drops) and training need
        not."""
        return not self._keys.done() or self._keys.result()

    def upload(self, trained, global_weights, result, metrics, ends_at) -> bool:
        """The masked upload, once the key exchange is done (False if it was refused: noted already)."""
        return self._keys.result() and super().upload(trained, global_weights, result, metrics, ends_at)

    def close(self) -> None:
        """Unmask in a thread of its own: it waits for the rest of the cohort's uploads."""
        self.unmasking = _in_thread(super().close, f"secagg-unmask-{self.session.auth.agent_id}")


class SecureMembers:
    """The host's members in secure rounds: their sessions from task arrival to unmasking, over ``stub``."""

    def __init__(self, stub: CoordinatorStub, poll_seconds: float):
        self.stub, self.poll_seconds = stub, poll_seconds
        # by task id, with its round, until a seat takes it; a task no seat took (its member dropped or went
        # offline) is forgotten when a later round's task arrives, so this holds at most about one cohort
        self._modes: dict[str, tuple[int, HostedSecureUpload]] = {}
        self._lock = threading.Lock()

    def arrived(self, auth: pb.AgentAuth, task: pb.TrainTask, layout: ModelLayout, chunk_bytes: int,
                note_refusal: NoteRefusal) -> None:
        """Start the key exchange of ``task``'s member now (a secure round's task; ``auth``: the member's session;
        ``chunk_bytes``: of its masked upload; ``note_refusal``: how its refusals are noted)."""
        session = SecureSession(self.stub, pb.AgentAuth(agent_id=auth.agent_id, token=auth.token), task,
                                self.poll_seconds)
        mode = HostedSecureUpload(session, layout, chunk_bytes, note_refusal)
        mode.start_keys()
        with self._lock:
            self._modes = {key: held for key, held in self._modes.items() if held[0] >= task.round}
            self._modes[task.task_id] = (task.round, mode)

    def take(self, task: pb.TrainTask) -> HostedSecureUpload | None:
        """The secure mode started for ``task`` (None: not a secure round's task)."""
        with self._lock:
            held = self._modes.pop(task.task_id, None)
        return held[1] if held else None


def _in_thread(fn, name: str) -> Future:
    """``fn()`` run in a daemon thread; its result (or exception) in the returned future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # the waiter sees it
            future.set_exception(exc)
    threading.Thread(target=run, name=name, daemon=True).start()
    return future
