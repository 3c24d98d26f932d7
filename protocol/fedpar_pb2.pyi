from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SecAggStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SECAGG_SETUP: _ClassVar[SecAggStage]
    SECAGG_ADVERTISE: _ClassVar[SecAggStage]
    SECAGG_SHARE: _ClassVar[SecAggStage]
    SECAGG_MASKED: _ClassVar[SecAggStage]
    SECAGG_UNMASK: _ClassVar[SecAggStage]
SECAGG_SETUP: SecAggStage
SECAGG_ADVERTISE: SecAggStage
SECAGG_SHARE: SecAggStage
SECAGG_MASKED: SecAggStage
SECAGG_UNMASK: SecAggStage

class AgentAuth(_message.Message):
    __slots__ = ("agent_id", "token")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    token: str
    def __init__(self, agent_id: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("agent_id", "num_examples", "capabilities", "protocol_version", "enrollment_token", "replaces_token", "incarnation")
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENROLLMENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REPLACES_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    num_examples: int
    capabilities: _containers.ScalarMap[str, str]
    protocol_version: int
    enrollment_token: str
    replaces_token: str
    incarnation: str
    def __init__(self, agent_id: _Optional[str] = ..., num_examples: _Optional[int] = ..., capabilities: _Optional[_Mapping[str, str]] = ..., protocol_version: _Optional[int] = ..., enrollment_token: _Optional[str] = ..., replaces_token: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("token", "heartbeat_seconds", "max_chunk_bytes")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    token: str
    heartbeat_seconds: float
    max_chunk_bytes: int
    def __init__(self, token: _Optional[str] = ..., heartbeat_seconds: _Optional[float] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class PullTaskRequest(_message.Message):
    __slots__ = ("auth", "wait_seconds", "finished_task_id", "failure")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    auth: AgentAuth
    wait_seconds: float
    finished_task_id: str
    failure: str
    def __init__(self, auth: _Optional[_Union[AgentAuth, _Mapping]] = ..., wait_seconds: _Optional[float] = ..., finished_task_id: _Optional[str] = ..., failure: _Optional[str] = ...) -> None: ...

class TrainTask(_message.Message):
    __slots__ = ("round", "task_id", "deadline_seconds", "local_epochs", "batch_size", "learning_rate", "extra_json", "model_bytes", "data_port", "data_ticket", "weights_header", "weights", "ingest_port", "ingest_host", "virtual_clock", "clock_seconds", "max_steps", "clock_deadline_seconds", "flower_message", "model_id")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HEADER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    INGEST_PORT_FIELD_NUMBER: _ClassVar[int]
    INGEST_HOST_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_CLOCK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FLOWER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    round: int
    task_id: str
    deadline_seconds: float
    local_epochs: int
    batch_size: int
    learning_rate: float
    extra_json: str
    model_bytes: int
    data_port: int
    data_ticket: bytes
    weights_header: ModelHeader
    weights: bytes
    ingest_port: int
    ingest_host: str
    virtual_clock: bool
    clock_seconds: float
    max_steps: int
    clock_deadline_seconds: float
    flower_message: bytes
    model_id: str
    def __init__(self, round: _Optional[int] = ..., task_id: _Optional[str] = ..., deadline_seconds: _Optional[float] = ..., local_epochs: _Optional[int] = ..., batch_size: _Optional[int] = ..., learning_rate: _Optional[float] = ..., extra_json: _Optional[str] = ..., model_bytes: _Optional[int] = ..., data_port: _Optional[int] = ..., data_ticket: _Optional[bytes] = ..., weights_header: _Optional[_Union[ModelHeader, _Mapping]] = ..., weights: _Optional[bytes] = ..., ingest_port: _Optional[int] = ..., ingest_host: _Optional[str] = ..., virtual_clock: bool = ..., clock_seconds: _Optional[float] = ..., max_steps: _Optional[int] = ..., clock_deadline_seconds: _Optional[float] = ..., flower_message: _Optional[bytes] = ..., model_id: _Optional[str] = ...) -> None: ...

class PullTaskReply(_message.Message):
    __slots__ = ("task", "wait_seconds", "shutdown_reason")
    TASK_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_REASON_FIELD_NUMBER: _ClassVar[int]
    task: TrainTask
    wait_seconds: float
    shutdown_reason: str
    def __init__(self, task: _Optional[_Union[TrainTask, _Mapping]] = ..., wait_seconds: _Optional[float] = ..., shutdown_reason: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ModelHeader(_message.Message):
    __slots__ = ("round", "tensors", "total_bytes")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    round: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    def __init__(self, round: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("auth", "round", "task_id")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    auth: AgentAuth
    round: int
    task_id: str
    def __init__(self, auth: _Optional[_Union[AgentAuth, _Mapping]] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ...) -> None: ...

class ModelChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ModelHeader
    data: DataChunk
    def __init__(self, header: _Optional[_Union[ModelHeader, _Mapping]] = ..., data: _Optional[_Union[DataChunk, _Mapping]] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("auth", "round", "task_id", "num_examples", "steps", "tensors", "total_bytes", "metrics", "encoding", "encoding_json")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    AUTH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    ENCODING_JSON_FIELD_NUMBER: _ClassVar[int]
    auth: AgentAuth
    round: int
    task_id: str
    num_examples: int
    steps: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    metrics: _containers.ScalarMap[str, float]
    encoding: str
    encoding_json: str
    def __init__(self, auth: _Optional[_Union[AgentAuth, _Mapping]] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., num_examples: _Optional[int] = ..., steps: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., encoding: _Optional[str] = ..., encoding_json: _Optional[str] = ...) -> None: ...

class MessageReply(_message.Message):
    __slots__ = ("auth", "round", "task_id", "message")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    auth: AgentAuth
    round: int
    task_id: str
    message: bytes
    def __init__(self, auth: _Optional[_Union[AgentAuth, _Mapping]] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., message: _Optional[bytes] = ...) -> None: ...

class UploadEnd(_message.Message):
    __slots__ = ("total_bytes", "num_chunks")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    num_chunks: int
    def __init__(self, total_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("header", "data", "end")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    data: DataChunk
    end: UploadEnd
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., data: _Optional[_Union[DataChunk, _Mapping]] = ..., end: _Optional[_Union[UploadEnd, _Mapping]] = ...) -> None: ...

class SmallUpload(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: bool = ..., message: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("auth",)
    AUTH_FIELD_NUMBER: _ClassVar[int]
    auth: AgentAuth
    def __init__(self, auth: _Optional[_Union[AgentAuth, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("current_round",)
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    current_round: int
    def __init__(self, current_round: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("auth",)
    AUTH_FIELD_NUMBER: _ClassVar[int]
    auth: AgentAuth
    def __init__(self, auth: _Optional[_Union[AgentAuth, _Mapping]] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SecAggPublicKeys(_message.Message):
    __slots__ = ("agent_id", "c_public", "s_public")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    C_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    S_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    c_public: bytes
    s_public: bytes
    def __init__(self, agent_id: _Optional[str] = ..., c_public: _Optional[bytes] = ..., s_public: _Optional[bytes] = ...) -> None: ...

class SecAggCiphertext(_message.Message):
    __slots__ = ("peer", "ciphertext")
    PEER_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    peer: str
    ciphertext: bytes
    def __init__(self, peer: _Optional[str] = ..., ciphertext: _Optional[bytes] = ...) -> None: ...

class SecAggShare(_message.Message):
    __slots__ = ("owner", "share")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    share: bytes
    def __init__(self, owner: _Optional[str] = ..., share: _Optional[bytes] = ...) -> None: ...

class SecAggUnmaskShares(_message.Message):
    __slots__ = ("self_mask_shares", "key_shares")
    SELF_MASK_SHARES_FIELD_NUMBER: _ClassVar[int]
    KEY_SHARES_FIELD_NUMBER: _ClassVar[int]
    self_mask_shares: _containers.RepeatedCompositeFieldContainer[SecAggShare]
    key_shares: _containers.RepeatedCompositeFieldContainer[SecAggShare]
    def __init__(self, self_mask_shares: _Optional[_Iterable[_Union[SecAggShare, _Mapping]]] = ..., key_shares: _Optional[_Iterable[_Union[SecAggShare, _Mapping]]] = ...) -> None: ...

class SecAggRequest(_message.Message):
    __slots__ = ("auth", "round", "task_id", "stage", "wait_seconds", "public_keys", "ciphertexts", "unmask_shares")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEYS_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    UNMASK_SHARES_FIELD_NUMBER: _ClassVar[int]
    auth: AgentAuth
    round: int
    task_id: str
    stage: SecAggStage
    wait_seconds: float
    public_keys: SecAggPublicKeys
    ciphertexts: SecAggCiphertexts
    unmask_shares: SecAggUnmaskShares
    def __init__(self, auth: _Optional[_Union[AgentAuth, _Mapping]] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., stage: _Optional[_Union[SecAggStage, str]] = ..., wait_seconds: _Optional[float] = ..., public_keys: _Optional[_Union[SecAggPublicKeys, _Mapping]] = ..., ciphertexts: _Optional[_Union[SecAggCiphertexts, _Mapping]] = ..., unmask_shares: _Optional[_Union[SecAggUnmaskShares, _Mapping]] = ...) -> None: ...

class SecAggCiphertexts(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SecAggCiphertext]
    def __init__(self, items: _Optional[_Iterable[_Union[SecAggCiphertext, _Mapping]]] = ...) -> None: ...

class SecAggKeys(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SecAggPublicKeys]
    def __init__(self, items: _Optional[_Iterable[_Union[SecAggPublicKeys, _Mapping]]] = ...) -> None: ...

class SecAggSurvivors(_message.Message):
    __slots__ = ("agent_ids",)
    AGENT_IDS_FIELD_NUMBER: _ClassVar[int]
    agent_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, agent_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SecAggReply(_message.Message):
    __slots__ = ("params_json", "keys", "ciphertexts", "survivors", "wait_seconds", "done")
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    params_json: str
    keys: SecAggKeys
    ciphertexts: SecAggCiphertexts
    survivors: SecAggSurvivors
    wait_seconds: float
    done: str
    def __init__(self, params_json: _Optional[str] = ..., keys: _Optional[_Union[SecAggKeys, _Mapping]] = ..., ciphertexts: _Optional[_Union[SecAggCiphertexts, _Mapping]] = ..., survivors: _Optional[_Union[SecAggSurvivors, _Mapping]] = ..., wait_seconds: _Optional[float] = ..., done: _Optional[str] = ...) -> None: ...

class JoinPopulationRequest(_message.Message):
    __slots__ = ("host", "protocol_version", "enrollment_token", "capabilities", "member_ids", "num_examples", "away", "replaces_token", "incarnation")
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HOST_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENROLLMENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    MEMBER_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    AWAY_FIELD_NUMBER: _ClassVar[int]
    REPLACES_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    host: AgentAuth
    protocol_version: int
    enrollment_token: str
    capabilities: _containers.ScalarMap[str, str]
    member_ids: str
    num_examples: _containers.RepeatedScalarFieldContainer[int]
    away: _containers.RepeatedScalarFieldContainer[int]
    replaces_token: str
    incarnation: str
    def __init__(self, host: _Optional[_Union[AgentAuth, _Mapping]] = ..., protocol_version: _Optional[int] = ..., enrollment_token: _Optional[str] = ..., capabilities: _Optional[_Mapping[str, str]] = ..., member_ids: _Optional[str] = ..., num_examples: _Optional[_Iterable[int]] = ..., away: _Optional[_Iterable[int]] = ..., replaces_token: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class JoinPopulationReply(_message.Message):
    __slots__ = ("host_token", "heartbeat_seconds", "max_chunk_bytes")
    HOST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    host_token: str
    heartbeat_seconds: float
    max_chunk_bytes: int
    def __init__(self, host_token: _Optional[str] = ..., heartbeat_seconds: _Optional[float] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class PullHostTasksRequest(_message.Message):
    __slots__ = ("host", "wait_seconds", "away", "back", "finish_estimates", "failures", "availability_at")
    HOST_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AWAY_FIELD_NUMBER: _ClassVar[int]
    BACK_FIELD_NUMBER: _ClassVar[int]
    FINISH_ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    AVAILABILITY_AT_FIELD_NUMBER: _ClassVar[int]
    host: AgentAuth
    wait_seconds: float
    away: _containers.RepeatedScalarFieldContainer[str]
    back: _containers.RepeatedScalarFieldContainer[str]
    finish_estimates: _containers.RepeatedCompositeFieldContainer[FinishEstimate]
    failures: _containers.RepeatedCompositeFieldContainer[TaskFailure]
    availability_at: float
    def __init__(self, host: _Optional[_Union[AgentAuth, _Mapping]] = ..., wait_seconds: _Optional[float] = ..., away: _Optional[_Iterable[str]] = ..., back: _Optional[_Iterable[str]] = ..., finish_estimates: _Optional[_Iterable[_Union[FinishEstimate, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[TaskFailure, _Mapping]]] = ..., availability_at: _Optional[float] = ...) -> None: ...

class FinishEstimate(_message.Message):
    __slots__ = ("agent_id", "task_id", "seconds")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    task_id: str
    seconds: float
    def __init__(self, agent_id: _Optional[str] = ..., task_id: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class TaskFailure(_message.Message):
    __slots__ = ("agent_id", "task_id", "reason")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    task_id: str
    reason: str
    def __init__(self, agent_id: _Optional[str] = ..., task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class HostedTask(_message.Message):
    __slots__ = ("agent_id", "task")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    task: TrainTask
    def __init__(self, agent_id: _Optional[str] = ..., task: _Optional[_Union[TrainTask, _Mapping]] = ...) -> None: ...

class PullHostTasksReply(_message.Message):
    __slots__ = ("tasks", "shutdown_reason", "weights_header", "weights", "go", "clock_seconds", "virtual_clock")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HEADER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    GO_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_CLOCK_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[HostedTask]
    shutdown_reason: str
    weights_header: ModelHeader
    weights: bytes
    go: _containers.RepeatedScalarFieldContainer[str]
    clock_seconds: float
    virtual_clock: bool
    def __init__(self, tasks: _Optional[_Iterable[_Union[HostedTask, _Mapping]]] = ..., shutdown_reason: _Optional[str] = ..., weights_header: _Optional[_Union[ModelHeader, _Mapping]] = ..., weights: _Optional[bytes] = ..., go: _Optional[_Iterable[str]] = ..., clock_seconds: _Optional[float] = ..., virtual_clock: bool = ...) -> None: ...

class HostUploads(_message.Message):
    __slots__ = ("host", "uploads", "partial", "failures")
    HOST_FIELD_NUMBER: _ClassVar[int]
    UPLOADS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    host: AgentAuth
    uploads: _containers.RepeatedCompositeFieldContainer[SmallUpload]
    partial: HostPartial
    failures: _containers.RepeatedCompositeFieldContainer[TaskFailure]
    def __init__(self, host: _Optional[_Union[AgentAuth, _Mapping]] = ..., uploads: _Optional[_Iterable[_Union[SmallUpload, _Mapping]]] = ..., partial: _Optional[_Union[HostPartial, _Mapping]] = ..., failures: _Optional[_Iterable[_Union[TaskFailure, _Mapping]]] = ...) -> None: ...

class HostPartial(_message.Message):
    __slots__ = ("round", "member_ids", "task_ids", "num_examples", "steps", "metric_names", "metric_values", "tensors", "total_bytes", "data")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_IDS_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    METRIC_NAMES_FIELD_NUMBER: _ClassVar[int]
    METRIC_VALUES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    round: int
    member_ids: str
    task_ids: str
    num_examples: _containers.RepeatedScalarFieldContainer[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    metric_names: _containers.RepeatedScalarFieldContainer[str]
    metric_values: _containers.RepeatedScalarFieldContainer[float]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    data: bytes
    def __init__(self, round: _Optional[int] = ..., member_ids: _Optional[str] = ..., task_ids: _Optional[str] = ..., num_examples: _Optional[_Iterable[int]] = ..., steps: _Optional[_Iterable[int]] = ..., metric_names: _Optional[_Iterable[str]] = ..., metric_values: _Optional[_Iterable[float]] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class HostUploadResult(_message.Message):
    __slots__ = ("accepted", "message", "code")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    code: int
    def __init__(self, accepted: bool = ..., message: _Optional[str] = ..., code: _Optional[int] = ...) -> None: ...

class HostUploadResults(_message.Message):
    __slots__ = ("results", "partial")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[HostUploadResult]
    partial: HostUploadResult
    def __init__(self, results: _Optional[_Iterable[_Union[HostUploadResult, _Mapping]]] = ..., partial: _Optional[_Union[HostUploadResult, _Mapping]] = ...) -> None: ...

class RankBroadcast(_message.Message):
    __slots__ = ("start", "open", "close", "model", "stop", "tick")
    START_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TICK_FIELD_NUMBER: _ClassVar[int]
    start: RankStart
    open: RankOpen
    close: RankClose
    model: RankModel
    stop: RankStop
    tick: RankTick
    def __init__(self, start: _Optional[_Union[RankStart, _Mapping]] = ..., open: _Optional[_Union[RankOpen, _Mapping]] = ..., close: _Optional[_Union[RankClose, _Mapping]] = ..., model: _Optional[_Union[RankModel, _Mapping]] = ..., stop: _Optional[_Union[RankStop, _Mapping]] = ..., tick: _Optional[_Union[RankTick, _Mapping]] = ...) -> None: ...

class RankStart(_message.Message):
    __slots__ = ("round", "control", "secret")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    round: int
    control: str
    secret: str
    def __init__(self, round: _Optional[int] = ..., control: _Optional[str] = ..., secret: _Optional[str] = ...) -> None: ...

class RankOpen(_message.Message):
    __slots__ = ("round", "deadline_seconds", "agents", "round_values", "hosts")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_VALUES_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    round: int
    deadline_seconds: float
    agents: _containers.RepeatedCompositeFieldContainer[RankAgent]
    round_values: _containers.RepeatedScalarFieldContainer[float]
    hosts: _containers.RepeatedCompositeFieldContainer[RankHost]
    def __init__(self, round: _Optional[int] = ..., deadline_seconds: _Optional[float] = ..., agents: _Optional[_Iterable[_Union[RankAgent, _Mapping]]] = ..., round_values: _Optional[_Iterable[float]] = ..., hosts: _Optional[_Iterable[_Union[RankHost, _Mapping]]] = ...) -> None: ...

class RankHost(_message.Message):
    __slots__ = ("host_id", "token", "cert_serial")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CERT_SERIAL_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    token: str
    cert_serial: bytes
    def __init__(self, host_id: _Optional[str] = ..., token: _Optional[str] = ..., cert_serial: _Optional[bytes] = ...) -> None: ...

class RankAgent(_message.Message):
    __slots__ = ("rank", "agent_id", "task_id", "token", "num_examples", "cert_serial", "ticket", "host")
    RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    CERT_SERIAL_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    rank: int
    agent_id: str
    task_id: str
    token: str
    num_examples: int
    cert_serial: bytes
    ticket: bytes
    host: str
    def __init__(self, rank: _Optional[int] = ..., agent_id: _Optional[str] = ..., task_id: _Optional[str] = ..., token: _Optional[str] = ..., num_examples: _Optional[int] = ..., cert_serial: _Optional[bytes] = ..., ticket: _Optional[bytes] = ..., host: _Optional[str] = ...) -> None: ...

class RankClose(_message.Message):
    __slots__ = ("round", "expected")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    round: int
    expected: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., expected: _Optional[_Iterable[int]] = ...) -> None: ...

class RankModel(_message.Message):
    __slots__ = ("round", "changed")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    round: int
    changed: bool
    def __init__(self, round: _Optional[int] = ..., changed: bool = ...) -> None: ...

class RankStop(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankTick(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankUpload(_message.Message):
    __slots__ = ("round", "agent_id", "task_id", "num_examples", "metrics", "upload_bytes")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    round: int
    agent_id: str
    task_id: str
    num_examples: int
    metrics: _containers.ScalarMap[str, float]
    upload_bytes: int
    def __init__(self, round: _Optional[int] = ..., agent_id: _Optional[str] = ..., task_id: _Optional[str] = ..., num_examples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., upload_bytes: _Optional[int] = ...) -> None: ...

class RankUploads(_message.Message):
    __slots__ = ("uploads", "count")
    UPLOADS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    uploads: _containers.RepeatedCompositeFieldContainer[RankUpload]
    count: int
    def __init__(self, uploads: _Optional[_Iterable[_Union[RankUpload, _Mapping]]] = ..., count: _Optional[int] = ...) -> None: ...

class RankRejection(_message.Message):
    __slots__ = ("round", "agent_id", "task_id", "counted", "reason")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    round: int
    agent_id: str
    task_id: str
    counted: RankUpload
    reason: str
    def __init__(self, round: _Optional[int] = ..., agent_id: _Optional[str] = ..., task_id: _Optional[str] = ..., counted: _Optional[_Union[RankUpload, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class RankDownload(_message.Message):
    __slots__ = ("round", "agent_id", "task_id")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    round: int
    agent_id: str
    task_id: str
    def __init__(self, round: _Optional[int] = ..., agent_id: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class RankAlive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunSubmit(_message.Message):
    __slots__ = ("name", "settings_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    settings_json: str
    def __init__(self, name: _Optional[str] = ..., settings_json: _Optional[str] = ...) -> None: ...

class RunRef(_message.Message):
    __slots__ = ("run_id", "warning")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    run_id: int
    warning: str
    def __init__(self, run_id: _Optional[int] = ..., warning: _Optional[str] = ...) -> None: ...

class RunQuery(_message.Message):
    __slots__ = ("after_id",)
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    after_id: int
    def __init__(self, after_id: _Optional[int] = ...) -> None: ...

class RunList(_message.Message):
    __slots__ = ("runs_json", "more")
    RUNS_JSON_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    runs_json: str
    more: bool
    def __init__(self, runs_json: _Optional[str] = ..., more: bool = ...) -> None: ...

class RunLogsRequest(_message.Message):
    __slots__ = ("run_id", "after_round", "follow")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_ROUND_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    run_id: int
    after_round: int
    follow: bool
    def __init__(self, run_id: _Optional[int] = ..., after_round: _Optional[int] = ..., follow: bool = ...) -> None: ...

class RunRound(_message.Message):
    __slots__ = ("metrics_json", "status", "line")
    METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    metrics_json: str
    status: str
    line: str
    def __init__(self, metrics_json: _Optional[str] = ..., status: _Optional[str] = ..., line: _Optional[str] = ...) -> None: ...

class RunFile(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...
