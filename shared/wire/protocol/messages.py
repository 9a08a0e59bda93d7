"""The messages that cross NATS about requests and instances, as frozen dataclasses registered by kind (see `base.py`
for the encoding): submissions and placements, response streams, cancellations, heartbeats, KV events and snapshots.
The messages that carry KV or hidden states are `kv_messages.py`'s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from shared.wire.protocol.base import Message, message
from shared.wire.protocol.sampling import SamplingParams


class Role(enum.StrEnum):
    GATEWAY = "gateway"
    SCHEDULER = "scheduler"
    PREFILL = "prefill"
    DECODE = "decode"
    CACHE_STORE = "cache-store"


class ErrorType(enum.StrEnum):
    """Why a request failed; the gateway maps these to HTTP statuses."""

    REJECTED = "rejected"  # admission said no (HTTP 429)
    UNAVAILABLE = "unavailable"  # no live instance, or one died holding the request (HTTP 503)
    KV_TRANSFER = "kv_transfer"  # missing or corrupt KV chunks (HTTP 502)
    INVALID = "invalid"  # the request cannot be served as asked (HTTP 400)
    INTERNAL = "internal"  # a bug (HTTP 500)


# ---- requests ------------------------------------------------------------------------------------------------


@message("submit")
@dataclass(frozen=True)
class SubmitRequest(Message):
    """gateway -> scheduler (request/reply on `sched.submit`): place this request. Reply: `SubmitReply`.

    `num_placed_before`: how many times it was placed already, its instance then lost (the gateway places it again;
    `SamplingParams.output_offset` says how much of the answer its client has). Work already accepted: the scheduler
    places it without judging the SLOs again.
    """

    VERSION: ClassVar[int] = 2  # num_placed_before, SamplingParams.output_offset

    request_id: str
    prompt_ids: list[int]
    block_hashes: list[int]  # chained hashes of the prompt's full blocks (docs/block-hash.md)
    sampling: SamplingParams
    arrival_time: float  # unix seconds at the gateway
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    num_placed_before: int = 0


@message("submit-reply")
@dataclass(frozen=True)
class SubmitReply(Message):
    """scheduler -> gateway: where the request went, or why it was not accepted."""

    VERSION: ClassVar[int] = 2

    request_id: str
    accepted: bool
    prefill_id: str = ""
    decode_id: str = ""
    error_type: str = ""  # an ErrorType value when not accepted
    reason: str = ""
    retry_after_s: float = 0.0
    reason_code: str = ""  # short and stable, for metrics labels: "ttft_slo", "tbt_slo", "no_prefill", "no_decode"


@message("prefill-task")
@dataclass(frozen=True)
class PrefillTask(Message):
    """scheduler -> one prefill instance (`prefill.<id>.run`): compute the prompt and hand it to `decode_id`.

    Also scheduler -> the decode instance itself (`decode.<id>.run`, conditional disaggregation): a short or mostly
    cached prompt is then prefilled where it will be decoded. `fetch_from_pool` says whether to load the prefix the
    cache-store holds beyond the local cache (the Conductor's balancing decision).
    """

    VERSION: ClassVar[int] = 3  # SamplingParams.output_offset
    request_id: str
    prompt_ids: list[int]
    block_hashes: list[int]
    sampling: SamplingParams
    decode_id: str
    arrival_time: float
    fetch_from_pool: bool = True


# ---- streaming back to the gateway ----------------------------------------------------------------------------


@message("stream-event")
@dataclass(frozen=True)
class StreamEvent(Message):
    """prefill or decode -> gateway (`stream.<request_id>`): new tokens, the end, or a failure.

    `index` is the position of the first token in `token_ids` among the request's output tokens, so the gateway
    can order events from the two publishers. A failure has `error_type` set and no tokens.
    """

    VERSION: ClassVar[int] = 2
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length", "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error_type: str = ""
    error: str = ""
    kv_bytes_saved: int = 0  # decode with FastGen: KV bytes this request does not hold after these tokens

    @classmethod
    def failure(cls, request_id: str, error_type: str, error: str) -> StreamEvent:
        """The end of a request that failed (index -1: it is delivered whatever arrived before)."""
        return cls(request_id, -1, [], "", error_type=error_type, error=error)


@message("cancel")
@dataclass(frozen=True)
class Cancel(Message):
    """gateway -> every scheduler, prefill and decode instance (`cancel`): drop this request wherever it is. Also
    prefill -> decode, closing a hand-off stream early (`decode.<id>.handoff`; see `HandoffStart`)."""

    request_id: str
    reason: str = "client disconnected"


# ---- instances and KV events -------------------------------------------------------------------------------


def attention_work(num_tokens: int, num_done: int) -> int:
    """Keys a sequence's tokens from `num_done` to `num_tokens` attend to, summed (causal: each sees every earlier token
    and itself). Additive over the chunks that compute them. The unit of a prefill step sample's second figure and of
    `Heartbeat.queued_attention_work`: the prefill cost model's second feature."""
    return (num_tokens * (num_tokens + 1) - num_done * (num_done + 1)) // 2


@message("heartbeat")
@dataclass(frozen=True)
class Heartbeat(Message):
    """Every instance -> scheduler and gateway (`sched.heartbeat.<role>.<instance>`), every `TSUKIMI_HEARTBEAT_S`:
    alive, and how loaded.

    `epoch` changes when the instance restarts (its caches are then empty); `request_ids` are the requests it
    holds now, so the scheduler can fail them if the instance dies.
    """

    VERSION: ClassVar[int] = 10

    instance_id: str
    role: str
    epoch: int
    sent_at: float
    num_running: int = 0
    num_waiting: int = 0
    num_queued_tokens: int = 0
    # Prefill: the attention work of those tokens (keys each will attend to, summed: the prefill cost model's second
    # feature), so the Conductor prices a queue of long prompts at what their chunks will cost.
    queued_attention_work: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    request_ids: list[str] = field(default_factory=list)
    # Step timings since the last beat, for the Conductor's cost models. Prefill: [new tokens, attention work
    # (sum over the step's new tokens of the context each attends to), seconds]; decode: [batch size, total context
    # tokens, seconds].
    samples: list[list[float]] = field(default_factory=list)
    # Decode: its steps that computed prompts and no decoding row (its warm-up's, or prompts computed there while
    # nothing decoded), in the form of prefill's samples: what a prompt costs where it is decoded (conditional
    # disaggregation, a colocated deployment) is priced from the instance's own hardware.
    prefill_samples: list[list[float]] = field(default_factory=list)
    fetch_bytes_per_s: float = 0.0  # prefill: measured cache-store -> prefill bandwidth (0: not measured yet)
    block_bytes: int = 0  # prefill and decode: bytes of one KV block (all layers), for transfer-time estimates
    # KV figures for /metrics. kv_format: how the engine stores KV blocks (EngineConfig.kv_format); kv_block_tokens:
    # tokens per block; kv_stored_bytes / kv_stored_blocks: what the cache-store's DRAM tier holds; kv_moved_bytes /
    # kv_moved_tokens: since start, prompt KV sent (prefill) or received (decode) on the wire, and its prompt tokens.
    kv_format: str = ""
    kv_block_tokens: int = 0
    kv_stored_bytes: int = 0
    kv_stored_blocks: int = 0
    kv_moved_bytes: int = 0
    kv_moved_tokens: int = 0
    kv_saved_bytes: int = 0  # decode with FastGen: KV bytes its running requests do not hold (against full caches)
    max_num_seqs: int = 0  # prefill and decode: the most sequences a step runs (0: not reported)
    max_batched_tokens: int = 0  # prefill and decode: the most tokens a step runs, its prefill chunk (0: not reported)
    # Prefill in a pipeline group (`TSUKIMI_CPP_GROUP`): the group's instances, first stage first, and the prompt
    # tokens to compute from which the first stage runs a prompt on the group (empty, 0: in no group); the bytes
    # of one token's hidden-state row that crosses each boundary between stages (before coding); the block-hash
    # namespace of its stage's KV blocks (`shared.wire.block_hash.make_namespace`, as text), under which its stage's
    # prefix cache and the cache-store's copies of its layers are in the KV events.
    pipeline_group: list[str] = field(default_factory=list)
    pipeline_min_tokens: int = 0
    pipeline_row_bytes: int = 0
    pipeline_namespace: str = ""


STORED, REMOVED, CLEARED = "stored", "removed", "cleared"  # the kinds of KvEvent


@message("kv-event")
@dataclass(frozen=True)
class KvEvent(Message):
    """A cache's change (`kv.events.<role>.<instance>`): blocks `stored`, `removed`, or everything `cleared`.

    `seq` counts events per (instance, epoch); a gap tells the listener to ask for a snapshot.
    """

    VERSION: ClassVar[int] = 2

    instance_id: str
    epoch: int
    seq: int
    kind: str  # "stored", "removed", "cleared"
    block_hashes: list[int] = field(default_factory=list)
    role: str = ""  # the sender's role, which its subject names too


# ---- cache-store --------------------------------------------------------------------------------------------


@message("snapshot-request")
@dataclass(frozen=True)
class SnapshotRequest(Message):
    """Ask an instance for every block its cache holds (`snapshot.<role>.<instance>`, request/reply -> `Snapshot`): the
    scheduler's resync after a gap in that instance's KV events or a new epoch."""

    instance_id: str


@message("snapshot")
@dataclass(frozen=True)
class Snapshot(Message):
    """Every block hash one instance's cache holds, as of its KV event `seq` in `epoch` (events after it apply on
    top)."""

    instance_id: str
    epoch: int
    seq: int  # the seq of the last event already reflected here (-1: none yet)
    block_hashes: list[int] = field(default_factory=list)


@message("ack")
@dataclass(frozen=True)
class Ack(Message):
    """A generic reply: ok, or an error message."""

    ok: bool = True
    error: str = ""


