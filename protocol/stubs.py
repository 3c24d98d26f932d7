"""Client stub for the Coordinator service with the raw-chunk fast path on the two streaming calls."""

from __future__ import annotations

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.messages import SERVICE_NAME
from fedpar.protocol.codec import decode_chunk_message


def _serialize(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class CoordinatorStub:
    """Like the generated stub, but uploads may mix pre-encoded bytes with messages, and downloads
    yield :class:`~fedpar.protocol.codec.RawData` for data chunks."""

    def __init__(self, channel: grpc.Channel):
        def method(name: str) -> str:
            return f"/{SERVICE_NAME}/{name}"

        self.Join = channel.unary_unary(method("Join"), request_serializer=_serialize,
                                        response_deserializer=pb.JoinReply.FromString)
        self.PullTask = channel.unary_unary(method("PullTask"), request_serializer=_serialize,
                                            response_deserializer=pb.PullTaskReply.FromString)
        self.DownloadWeights = channel.unary_stream(
            method("DownloadWeights"), request_serializer=_serialize,
            response_deserializer=lambda raw: decode_chunk_message(raw, pb.ModelChunk))
        self.UploadUpdate = channel.stream_unary(method("UploadUpdate"), request_serializer=_serialize,
                                                 response_deserializer=pb.UploadReply.FromString)
        self.UploadSmall = channel.unary_unary(method("UploadSmall"), request_serializer=_serialize,
                                               response_deserializer=pb.UploadReply.FromString)
        self.Heartbeat = channel.unary_unary(method("Heartbeat"), request_serializer=_serialize,
                                             response_deserializer=pb.HeartbeatReply.FromString)
        self.Leave = channel.unary_unary(method("Leave"), request_serializer=_serialize,
                                         response_deserializer=pb.LeaveReply.FromString)
        self.JoinPopulation = channel.unary_unary(method("JoinPopulation"), request_serializer=_serialize,
                                                  response_deserializer=pb.JoinPopulationReply.FromString)
        self.PullHostTasks = channel.unary_unary(method("PullHostTasks"), request_serializer=_serialize,
                                                 response_deserializer=pb.PullHostTasksReply.FromString)
        self.UploadHostUpdates = channel.unary_unary(method("UploadHostUpdates"), request_serializer=_serialize,
                                                     response_deserializer=pb.HostUploadResults.FromString)
        self.SecAggExchange = channel.unary_unary(method("SecAggExchange"), request_serializer=_serialize,
                                                  response_deserializer=pb.SecAggReply.FromString)
