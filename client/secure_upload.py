"""The agent's side of a secure-aggregation round: SecAgg+ stages over SecAggExchange, masked upload, and the round
mode that runs them for a task (:class:`SecureUpload`, beside client/transfer.py's plain and compressed modes).

Use: ``begin`` as soon as the task arrives (key exchange overlaps other agents' training), then, after
local training, ``upload_masked`` with the update local - global, then ``unmask``. A refusal surfaces as
grpc.RpcError (with the coordinator's status and reason), SecAggError or SecAggAbort.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import grpc
import numpy as np

from fedpar.client.transfer import NoteRefusal, dp_settings, privatize_update, upload_messages, upload_update
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CoordinatorStub, ModelLayout
from fedpar.protocol.task_settings import TaskSettings
from fedpar.secagg import wire
from fedpar.secagg.client_protocol import SecAggClient
from fedpar.secagg.errors import SecAggAbort, SecAggError
from fedpar.secagg.params import RoundParams

if TYPE_CHECKING:  # only named: the result comes from a trainer
    from fedpar.client.local_loop import TrainResult

MASKED_TENSOR = "secagg.masked"


def flat_update(local: Sequence[np.ndarray], global_weights: Sequence[np.ndarray]) -> np.ndarray:
    """local - global of every tensor, flattened and concatenated, as float64."""
    return np.concatenate([(np.asarray(a, np.float64) - np.asarray(b, np.float64)).reshape(-1)
                           for a, b in zip(local, global_weights)])


class SecureSession:
    """One agent in one secure-aggregation round."""

    def __init__(self, stub: CoordinatorStub, auth: pb.AgentAuth, task: pb.TrainTask, poll_seconds: float = 5.0,
                 stage_timeout: float = 120.0):
        self.stub, self.auth, self.task = stub, auth, task
        self.poll_seconds = poll_seconds
        self.stage_timeout = stage_timeout
        self.client: SecAggClient | None = None
        self.bytes_sent = 0  # SecAggExchange requests plus the masked vector's data
        self.bytes_received = 0  # SecAggExchange replies
        self.compute_cpu_seconds = 0.0  # CPU time of local cryptography and masking (no network waits)

    def _call(self, stage: int, wait: bool = True, **body) -> pb.SecAggReply:
        """Send this stage's message (once), then poll until the server's broadcast or ``stage_timeout``."""
        end = time.monotonic() + self.stage_timeout
        request = pb.SecAggRequest(auth=self.auth, round=self.task.round, task_id=self.task.task_id, stage=stage,
                                   wait_seconds=self.poll_seconds if wait else 0.0, **body)
        while True:
            self.bytes_sent += request.ByteSize()
            asked = time.monotonic()
            reply = self.stub.SecAggExchange(request, timeout=self.poll_seconds + 30)
            self.bytes_received += reply.ByteSize()
            if reply.WhichOneof("body") != "wait_seconds" or not wait:
                return reply
            if time.monotonic() > end:
                raise SecAggAbort(f"no secure-aggregation broadcast for stage {pb.SecAggStage.Name(stage)} "
                                  f"within {self.stage_timeout}s")
            # The coordinator answers "wait" once the wait asked for (at most its cap) has passed: one that answers
            # at once is asked at most once a second, not in a loop of calls as fast as it answers.
            time.sleep(max(0.0, min(asked + min(self.poll_seconds, 1.0), end) - time.monotonic()))
            request = pb.SecAggRequest(auth=self.auth, round=self.task.round, task_id=self.task.task_id,
                                       stage=stage, wait_seconds=self.poll_seconds)

    def _expect(self, reply: pb.SecAggReply, kind: str):
        if reply.WhichOneof("body") != kind:
            raise SecAggError(f"expected {kind} from the coordinator, got {reply.WhichOneof('body')}")
        return getattr(reply, kind)

    def begin(self, vector_length: int) -> RoundParams:
        """Stages 0-2: fetch and check the settings, advertise keys, send encrypted shares to the neighbours."""
        params = RoundParams.from_json(self._expect(self._call(pb.SECAGG_SETUP, wait=False), "params_json"))
        me = self.auth.agent_id
        if params.round_id != self.task.round or params.vector_length != vector_length:
            raise SecAggError(f"secure-aggregation settings are for round {params.round_id} and "
                              f"{params.vector_length} values; this task is round {self.task.round} with "
                              f"{vector_length}")
        start = time.thread_time()
        self.client = SecAggClient(params, me)
        advert = wire.advertise_to_pb(self.client.advertise())
        self.compute_cpu_seconds += time.thread_time() - start
        keys = self._expect(self._call(pb.SECAGG_ADVERTISE, public_keys=advert), "keys")
        start = time.thread_time()
        shares = self.client.share_keys(wire.key_broadcast_from_pb(me, keys))
        self.compute_cpu_seconds += time.thread_time() - start
        self._call(pb.SECAGG_SHARE, wait=False, ciphertexts=wire.ciphertexts_to_pb(shares.ciphertexts))
        return params

    def upload_masked(self, update: np.ndarray, weight: int, metrics: dict[str, float], chunk_bytes: int,
                      timeout: float) -> pb.UploadReply:
        """Stage 3: receive the shares addressed to us, mask the weighted update, stream it up."""
        me = self.auth.agent_id
        routed = self._expect(self._call(pb.SECAGG_SHARE), "ciphertexts")
        weight = max(1, min(int(weight), self.client.params.max_weight))
        start = time.thread_time()
        masked = self.client.masked_input(wire.routed_shares_from_pb(me, routed), update, weight)
        array = masked.vector.view(np.int32)
        self.compute_cpu_seconds += time.thread_time() - start
        layout = ModelLayout([(MASKED_TENSOR, "int32", array.shape)])
        # num_examples=1: the real weight rides inside the masked vector, not in the clear.
        messages = upload_messages(self.auth, self.task, layout, [array], 1, 0, metrics, chunk_bytes)
        self.bytes_sent += array.nbytes
        return upload_update(self.stub, messages, timeout=timeout)

    def unmask(self) -> str:
        """Stage 4: hear who survived and send the shares that remove their masks."""
        me = self.auth.agent_id
        survivors = self._expect(self._call(pb.SECAGG_MASKED), "survivors")
        start = time.thread_time()
        shares = self.client.unmask(wire.unmask_request_from_pb(me, survivors))
        self.compute_cpu_seconds += time.thread_time() - start
        return self._expect(self._call(pb.SECAGG_UNMASK, wait=False,
                                       unmask_shares=wire.unmask_shares_to_pb(shares)), "done")


class SecureUpload:
    """Secure rounds: keys exchanged while training, then a masked vector, then the shares that unmask the sum."""

    REFUSALS = (grpc.RpcError, SecAggError, SecAggAbort)

    def __init__(self, session: SecureSession, layout: ModelLayout, chunk_bytes: int, note_refusal: NoteRefusal):
        self.session = session
        # client-side DP (clip norm, local noise): each update clipped here, weighing 1, and its clip bit summed
        # with the updates as one more masked value (Andrew et al.'s count, which the coordinator sees only summed)
        self.dp = dp_settings(TaskSettings.from_json(session.task.extra_json))
        self.vector_length = sum(t.numel for t in layout.tensors) + (1 if self.dp is not None else 0)
        self.chunk_bytes = chunk_bytes
        self.note_refusal = note_refusal

    def begin(self) -> bool:
        """The key exchange (stages 0-2), here and now: client/secure_members.py runs it in a thread of its own from
        the task's arrival, so that it overlaps the download and training."""
        try:
            self.session.begin(self.vector_length)
        except self.REFUSALS as err:
            self.note_refusal("secure aggregation", err)
            return False
        return True

    def upload(self, trained: list[np.ndarray], global_weights: list[np.ndarray], result: TrainResult,
               metrics: dict[str, float], ends_at: float) -> bool:
        """Mask and send local - global, weighted by the examples seen (with client-side DP: clipped, weighing 1,
        its clip bit last), over by ``ends_at``."""
        try:
            if self.dp is None:
                update, weight = flat_update(trained, global_weights), result.examples
            else:
                update, weight = self._private_update(trained, global_weights), 1
            # No metrics in the clear: the coordinator of a secure round learns only the weighted sum.
            self.session.upload_masked(update, weight, {}, self.chunk_bytes, timeout=ends_at - time.monotonic())
        except self.REFUSALS as err:
            self.note_refusal("secure aggregation", err)
            return False
        return True

    def _private_update(self, trained: list[np.ndarray], global_weights: list[np.ndarray]) -> np.ndarray:
        """The clipped update and its clip bit after it (the coordinator sees only the bits' count)."""
        private, clipped = privatize_update(trained, global_weights, self.dp)
        bit = self.session.client.params.bit_value if clipped else 0.0
        return np.concatenate([flat_update(private, global_weights), np.array([bit], np.float64)])

    def close(self) -> None:
        """Wait for the round to close, then send the shares that remove the survivors' masks from the sum."""
        try:
            self.session.unmask()
        except self.REFUSALS as err:
            self.note_refusal("secure aggregation", err)
