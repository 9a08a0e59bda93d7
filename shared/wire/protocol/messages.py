"""Every message that crosses NATS, as frozen dataclasses registered by kind (see `base.py` for the encoding).

Payload bytes inside messages are coded by `shared.wire.parts`, not here.
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
    """gateway -> scheduler (request/reply on `sched.submit`): place this request. Reply: `SubmitReply`."""

    request_id: str
    prompt_ids: list[int]
    block_hashes: list[int]  # chained hashes of the prompt's full blocks (docs/block-hash.md)
    sampling: SamplingParams
    arrival_time: float  # unix seconds at the gateway
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None


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

    VERSION: ClassVar[int] = 2
    request_id: str
    prompt_ids: list[int]
    block_hashes: list[int]
    sampling: SamplingParams
    decode_id: str
    arrival_time: float
    fetch_from_pool: bool = True


@message("expect-handoff")
@dataclass(frozen=True)
class ExpectHandoff(Message):
    """scheduler -> decode (`decode.<id>.run`), before it sends the `PrefillTask`: `prefill_id` will hand this request
    over. Its KV stream may then use decode's whole KV buffer (streams nobody announced get a small share of it)."""

    request_id: str
    prefill_id: str
    num_prompt_tokens: int


@message("handoff-start")
@dataclass(frozen=True)
class HandoffStart(Message):
    """prefill -> decode (`decode.<id>.handoff`), before the prompt's first KV chunk: a request's hand-off stream
    opens.

    The stream is this message, then `num_kv_chunks` `KvChunk`s (layer by layer, as prefill computes them), then any
    `FastGenProfilePart`s, then `HandoffEnd`; or a `Cancel` closes it early (the request finished or failed at
    prefill, which wrote its response stream). Prefill publishes all of it on one subject over one connection, which
    NATS delivers in order.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    prefill_id: str
    num_kv_chunks: int


@message("handoff-end")
@dataclass(frozen=True)
class HandoffEnd(Message):
    """prefill -> decode (`decode.<id>.handoff`), last on a hand-off stream: the prompt is computed.

    `first_token` was sampled by prefill; decode writes the request's response stream from here on, beginning with
    this token and `first_text` (what prefill's detokenizer released for it). `num_profile_parts`
    `FastGenProfilePart`s came before this message (0: keep every token).
    """

    request_id: str
    first_token: int
    first_text: str
    num_cached_tokens: int
    num_profile_parts: int = 0


@message("fastgen-profile-part")
@dataclass(frozen=True)
class FastGenProfilePart(Message):
    """prefill -> decode (`decode.<id>.handoff`), after the prompt's KV chunks: one part of its FastGen profile, so
    decode keeps per layer and KV head only what that head's policy keeps (`shared.wire.handoff.profile`).

    `policies` is uint8 [num_layers, num_kv_heads] (every part repeats it); the parts' bytes, decoded as `codec` says
    and joined in `seq` order, are the prompt's accumulated attention, float32 [num_layers, num_kv_heads, num_tokens];
    `checksum` is xxh3-64 of this part's `data` (`shared.wire.parts`).
    """

    request_id: str
    seq: int
    total: int
    num_tokens: int
    policies: bytes
    codec: str
    raw_size: int
    checksum: int
    data: bytes


@message("kv-chunk")
@dataclass(frozen=True)
class KvChunk(Message):
    """One piece of a request's prompt KV (prefill -> decode on `decode.<id>.handoff`), a part of its hand-off stream.

    `data` holds one layer's whole blocks in the engines' KV format (`kv_format`: raw tensors of a dtype, or a
    codec's bytes), tokens [token_start, token_end), then, in the last chunk of a layer, the partial last block's
    tokens in `dtype`; coded as `codec` says; `checksum` is xxh3-64 of the coded bytes (`shared.wire.parts`). See
    `shared.wire.handoff.prompt`.
    """

    request_id: str
    seq: int  # 0 .. total-1
    total: int
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    dtype: str
    codec: str  # "raw" or "lz4-shuffle"
    raw_size: int
    checksum: int
    data: bytes
    kv_format: str = ""  # the engines' KV format (EngineConfig.kv_format); chunks without one are refused
    block_size: int = 0  # tokens per block of the sending engine (the receiving one must page alike)


# ---- between the stages of a prefill pipeline group -----------------------------------------------------------


@message("stage-task")
@dataclass(frozen=True)
class StageTask(Message):
    """prefill stage -> the next stage of its pipeline group (`prefill.<id>.stage`), before any rows: compute `task`'s
    prompt from token `start` (the first stage reused the tokens before it) with this stage's layers, as its rows
    arrive (`StageRows`), and stream those layers' KV to `task.decode_id` within the request's hand-off stream of
    `num_kv_chunks` chunks (as many for every layer, numbered layer by layer). Also stage -> the other stages of
    its group: `Cancel`, when it fails the request."""

    task: PrefillTask
    start: int
    num_kv_chunks: int


@message("stage-rows")
@dataclass(frozen=True)
class StageRows(Message):
    """prefill stage -> the next stage (`prefill.<id>.stage`): one part of the residual stream of a prompt's tokens
    [token_start, token_end), rows of `hidden_size` values in `dtype` ("bf16", "fp16", "fp32"); the parts of one range
    (`seq` of `total`), decoded as `codec` says and joined, are its rows; `checksum` is xxh3-64 of this part's coded
    `data` (`shared.wire.parts`). See `shared.wire.handoff.stage_rows`."""

    request_id: str
    token_start: int
    token_end: int
    hidden_size: int
    dtype: str
    seq: int
    total: int
    codec: str
    raw_size: int
    checksum: int
    data: bytes


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

    VERSION: ClassVar[int] = 6

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
    # Prefill in a pipeline group (`TSUKIMI_CPP_GROUP`): the group's instances, first stage first, and the prompt
    # tokens to compute from which the first stage runs a prompt on the group (empty, 0: in no group).
    pipeline_group: list[str] = field(default_factory=list)
    pipeline_min_tokens: int = 0


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


@message("block-put")
@dataclass(frozen=True)
class BlockPut(Message):
    """Part `seq` of `total` of one block's bytes (`cache.<shard>.put`, request/reply -> `Ack`), coded as `codec`
    says; `checksum` is xxh3-64 of this part's `data` (`shared.wire.parts`).

    The store commits a block only when every part arrived and verified (two-phase: parts, then commit). `tag` binds
    the part to its block hash and place under the writers' key (`shared.wire.block_integrity`); the store keeps it and
    readers check it. `replace` (part 0): the copy stored under this hash failed a reader's check; put this instead.
    """

    VERSION: ClassVar[int] = 3

    block_hash: int
    seq: int
    total: int
    codec: str
    raw_size: int
    checksum: int
    data: bytes
    tag: bytes = b""
    replace: bool = False


@message("block-get")
@dataclass(frozen=True)
class BlockGet(Message):
    """Ask for part `seq` of a stored block (`cache.<shard>.get`, request/reply -> `BlockPart`)."""

    VERSION: ClassVar[int] = 2

    block_hash: int
    seq: int = 0


@message("block-part")
@dataclass(frozen=True)
class BlockPart(Message):
    """One part of a stored block as it was put (with the `tag` it was put with), or `found=False`."""

    VERSION: ClassVar[int] = 3

    block_hash: int
    found: bool
    seq: int = 0
    total: int = 0
    codec: str = "raw"
    raw_size: int = 0
    checksum: int = 0
    data: bytes = b""
    tag: bytes = b""


@message("block-has")
@dataclass(frozen=True)
class BlockHas(Message):
    """Which of these blocks does the shard hold (`cache.<shard>.has`, request/reply -> `BlockHasReply`)."""

    block_hashes: list[int]


@message("block-has-reply")
@dataclass(frozen=True)
class BlockHasReply(Message):
    present: list[bool]


@message("ack")
@dataclass(frozen=True)
class Ack(Message):
    """A generic reply: ok, or an error message."""

    ok: bool = True
    error: str = ""


