"""The load-test swarm's upload survives a coordinator that ends the call while data is still being written."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from fedpar.client.transfer import upload_messages
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.messages import SERVICE_NAME
from fedpar.protocol.stubs import CoordinatorStub
from fedpar.simulations.swarm import _retryable_upload_error, _send_when_admitted


async def _refuse_at_once(request_iterator, context):
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy: too many uploads in flight")


@pytest.mark.parametrize("params", [50_000, 100_000])  # 200 KB: data follows the header; 400 KB: waits
def test_a_refusal_while_chunks_are_still_written_is_a_retryable_status_not_a_crash(params):
    async def main() -> grpc.aio.AioRpcError:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE_NAME, {"UploadUpdate": grpc.stream_unary_rpc_method_handler(_refuse_at_once)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            update = [np.ones(params, np.float32)]
            task = pb.TrainTask(round=1, task_id="t")
            messages = upload_messages(pb.AgentAuth(agent_id="a", token="x"), task, ModelLayout.of_arrays(["w"], update),
                                       update, 10, 1, {}, chunk_bytes=1024)  # ~200 writes after the refusal
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _send_when_admitted(CoordinatorStub(channel), messages, timeout=10)
            return err.value
        finally:
            await channel.close()
            await server.stop(0)

    for _ in range(5):
        # The refusal itself, or INTERNAL "Internal error from Core" when a write races it (grpc/grpc#36066);
        # a write after the call ended must not escape as asyncio.InvalidStateError (it used to kill the swarm).
        err = asyncio.run(main())
        assert _retryable_upload_error(err), (err.code(), err.details())
