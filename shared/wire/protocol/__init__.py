"""The wire protocol: every message that crosses NATS (`messages.py`), its msgpack encoding (`base.py`) and every
subject (`subjects.py`). Import from here: `from shared.wire.protocol import HandoffStart, Subjects, encode, decode`.
"""

from shared.wire.protocol import checks  # noqa: E402, F401  (registers every message's invariants with decode)
from shared.wire.protocol.base import (
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    decode,
    encode,
    message,
    message_types,
    unchecked_fields,
)
from shared.wire.protocol.kv_messages import (
    BlockGet,
    BlockHas,
    BlockHasReply,
    BlockPart,
    BlockPut,
    ExpectHandoff,
    FastGenProfilePart,
    HandoffEnd,
    HandoffStart,
    KvChunk,
    StageRows,
    StageTask,
)
from shared.wire.protocol.messages import (
    Ack,
    Cancel,
    ErrorType,
    Heartbeat,
    KvEvent,
    PrefillTask,
    Role,
    Snapshot,
    SnapshotRequest,
    StreamEvent,
    SubmitReply,
    SubmitRequest,
    attention_work,
)
from shared.wire.protocol.sampling import SamplingError, SamplingParams
from shared.wire.protocol.subjects import PREFILL_QUEUE, SCHEDULER_QUEUE, Subjects, is_valid_request_id

__all__ = [
    "PROTOCOL_VERSION", "PREFILL_QUEUE", "SCHEDULER_QUEUE", "Ack", "BlockGet", "BlockHas", "BlockHasReply",
    "BlockPart", "BlockPut", "Cancel", "ErrorType", "ExpectHandoff", "FastGenProfilePart", "HandoffEnd",
    "HandoffStart", "Heartbeat", "KvChunk", "KvEvent", "Message",
    "PrefillTask", "ProtocolError", "Role", "SamplingError", "SamplingParams", "Snapshot", "SnapshotRequest",
    "StageRows", "StageTask",
    "StreamEvent", "SubmitReply", "SubmitRequest", "Subjects",
    "attention_work", "decode", "encode", "is_valid_request_id", "message", "message_types", "unchecked_fields",
]
