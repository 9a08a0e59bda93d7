"""The messages that carry KV or hidden states, as frozen dataclasses registered by kind (see `base.py` for the
encoding): a request's hand-off from prefill to decode, the hidden states between the stages of a pipeline group, and
the cache-store's blocks. Their payload bytes are coded by `shared.wire.parts`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.wire.protocol.base import Message, message
from shared.wire.protocol.messages import PrefillTask
from shared.wire.protocol.sampling import SamplingParams

# ---- prefill -> decode --------------------------------------------------------------------------------------


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
    NATS delivers in order. In a pipeline group each stage publishes its own layers' chunks, and the order holds
    through the group: a stage sends the next its last hidden states only once its chunks are out, and the last stage
    ends the stream.
    """

    VERSION: ClassVar[int] = 2  # SamplingParams.output_offset

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


# ---- cache-store --------------------------------------------------------------------------------------------


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
