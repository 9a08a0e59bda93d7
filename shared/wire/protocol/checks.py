"""What every decoded message must satisfy whoever sent it: ids that are subject tokens, counts that are not negative,
hashes that are 64-bit, finite times, parts within their totals. `decode` runs these after the field types; what
depends on the receiver (the vocabulary, the context, its block size) its service checks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from shared.wire.protocol.base import ProtocolError, invariants
from shared.wire.protocol.kv_messages import (
    BlockGet,
    BlockHas,
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
    CLEARED,
    REMOVED,
    STORED,
    Cancel,
    Heartbeat,
    KvEvent,
    PrefillTask,
    Role,
    Snapshot,
    SnapshotRequest,
    StreamEvent,
    SubmitReply,
    SubmitRequest,
)
from shared.wire.protocol.subjects import is_subject_token, is_valid_request_id

U64 = 1 << 64
MAX_PARTS = 1 << 20  # chunks or parts of one transfer: far beyond any prompt, small enough to count through
KV_EVENT_KINDS = (STORED, REMOVED, CLEARED)
TAG_BYTES = 16  # a block part's tag (shared.wire.block_integrity)
MAX_NAMESPACE_CHARS = 256  # a block-hash namespace: "tsukimi/v1|<fingerprint>|<KV format>"


def _require(condition: bool, kind: str, what: str) -> None:
    if not condition:
        raise ProtocolError(f"{kind}: {what}")


def _request_id(kind: str, request_id: str) -> None:
    _require(is_valid_request_id(request_id), kind, f"request id {request_id[:40]!r} is not a subject token "
                                                    "(letters, digits, '-' and '_')")


def _token(kind: str, name: str, value: str) -> None:
    ok = is_subject_token(value, 128)
    _require(ok, kind, f"{name} {value[:40]!r} is not 1-128 letters, digits, '-' or '_'")


def _non_negative(kind: str, **counts: int | float) -> None:
    for name, value in counts.items():
        _require(value >= 0, kind, f"{name} is negative ({value})")


def _hashes(kind: str, hashes: Iterable[int]) -> None:
    hashes = list(hashes)
    _require(not hashes or (min(hashes) >= 0 and max(hashes) < U64), kind, "a block hash outside 0..2**64-1")


def _tokens(kind: str, token_ids: list[int], allow_empty: bool = False) -> None:
    _require(allow_empty or bool(token_ids), kind, "no token ids")
    _require(not token_ids or min(token_ids) >= 0, kind, "a negative token id")


def _finite(kind: str, **values: float | None) -> None:
    for name, value in values.items():
        _require(value is None or math.isfinite(value), kind, f"{name} is not a finite number")


def _part(kind: str, seq: int, total: int) -> None:
    _require(0 <= seq < total <= MAX_PARTS, kind, f"part {seq} of {total} (at most {MAX_PARTS} parts)")


@invariants(SubmitRequest)
def _submit(msg: SubmitRequest) -> None:
    _request_id(msg.KIND, msg.request_id)
    _tokens(msg.KIND, msg.prompt_ids)
    _hashes(msg.KIND, msg.block_hashes)
    _finite(msg.KIND, arrival_time=msg.arrival_time, ttft_slo_s=msg.ttft_slo_s, tbt_slo_s=msg.tbt_slo_s)
    for name, slo in (("ttft_slo_s", msg.ttft_slo_s), ("tbt_slo_s", msg.tbt_slo_s)):
        _require(slo is None or slo > 0, msg.KIND, f"{name} must be positive")
    _non_negative(msg.KIND, num_placed_before=msg.num_placed_before)


@invariants(SubmitReply)
def _submit_reply(msg: SubmitReply) -> None:
    _request_id(msg.KIND, msg.request_id)
    _finite(msg.KIND, retry_after_s=msg.retry_after_s)


@invariants(PrefillTask)
def _prefill_task(msg: PrefillTask) -> None:
    _request_id(msg.KIND, msg.request_id)
    _token(msg.KIND, "decode_id", msg.decode_id)
    _tokens(msg.KIND, msg.prompt_ids)
    _hashes(msg.KIND, msg.block_hashes)
    _finite(msg.KIND, arrival_time=msg.arrival_time)


@invariants(ExpectHandoff)
def _expect_handoff(msg: ExpectHandoff) -> None:
    _request_id(msg.KIND, msg.request_id)
    _token(msg.KIND, "prefill_id", msg.prefill_id)
    _require(msg.num_prompt_tokens > 0, msg.KIND, "no prompt tokens")


@invariants(HandoffStart)
def _handoff_start(msg: HandoffStart) -> None:
    _request_id(msg.KIND, msg.request_id)
    _token(msg.KIND, "prefill_id", msg.prefill_id)
    _tokens(msg.KIND, msg.prompt_ids)
    _require(0 < msg.num_kv_chunks <= MAX_PARTS, msg.KIND, f"{msg.num_kv_chunks} KV chunks")


@invariants(HandoffEnd)
def _handoff_end(msg: HandoffEnd) -> None:
    _request_id(msg.KIND, msg.request_id)
    _tokens(msg.KIND, [msg.first_token])
    _non_negative(msg.KIND, num_cached_tokens=msg.num_cached_tokens, num_profile_parts=msg.num_profile_parts)
    _require(msg.num_profile_parts <= MAX_PARTS, msg.KIND, f"{msg.num_profile_parts} profile parts")


@invariants(FastGenProfilePart)
def _profile_part(msg: FastGenProfilePart) -> None:
    _request_id(msg.KIND, msg.request_id)
    _part(msg.KIND, msg.seq, msg.total)
    _non_negative(msg.KIND, num_tokens=msg.num_tokens, raw_size=msg.raw_size)
    _require(0 <= msg.checksum < U64, msg.KIND, "checksum outside 64 bits")


@invariants(KvChunk)
def _kv_chunk(msg: KvChunk) -> None:
    _request_id(msg.KIND, msg.request_id)
    _part(msg.KIND, msg.seq, msg.total)
    _non_negative(msg.KIND, layer_start=msg.layer_start, token_start=msg.token_start, raw_size=msg.raw_size)
    _require(msg.layer_start < msg.layer_end and msg.token_start < msg.token_end, msg.KIND, "an empty range")
    _require(0 <= msg.checksum < U64, msg.KIND, "checksum outside 64 bits")


@invariants(StageTask)
def _stage_task(msg: StageTask) -> None:
    _prefill_task(msg.task)
    _require(0 <= msg.start < len(msg.task.prompt_ids), msg.KIND, f"start {msg.start} outside the prompt")
    _require(0 < msg.num_kv_chunks <= MAX_PARTS, msg.KIND, f"{msg.num_kv_chunks} KV chunks")


@invariants(StageRows)
def _stage_rows(msg: StageRows) -> None:
    _request_id(msg.KIND, msg.request_id)
    _part(msg.KIND, msg.seq, msg.total)
    _non_negative(msg.KIND, token_start=msg.token_start, raw_size=msg.raw_size)
    _require(msg.token_start < msg.token_end, msg.KIND, "an empty range")
    _require(msg.hidden_size > 0, msg.KIND, f"hidden size {msg.hidden_size}")
    _require(0 <= msg.checksum < U64, msg.KIND, "checksum outside 64 bits")


@invariants(StreamEvent)
def _stream_event(msg: StreamEvent) -> None:
    _request_id(msg.KIND, msg.request_id)
    _require(msg.index >= -1, msg.KIND, f"index {msg.index}")
    _tokens(msg.KIND, msg.token_ids, allow_empty=True)
    _non_negative(msg.KIND, num_prompt_tokens=msg.num_prompt_tokens, num_cached_tokens=msg.num_cached_tokens,
                  kv_bytes_saved=msg.kv_bytes_saved)


@invariants(Cancel)
def _cancel(msg: Cancel) -> None:
    _request_id(msg.KIND, msg.request_id)


@invariants(Heartbeat)
def _heartbeat(msg: Heartbeat) -> None:
    _token(msg.KIND, "instance_id", msg.instance_id)
    _require(msg.role in tuple(Role), msg.KIND, f"unknown role {msg.role[:40]!r}")
    _finite(msg.KIND, sent_at=msg.sent_at, fetch_bytes_per_s=msg.fetch_bytes_per_s,
            queued_attention_work=msg.queued_attention_work)
    _non_negative(msg.KIND, num_running=msg.num_running, num_waiting=msg.num_waiting,
                  num_queued_tokens=msg.num_queued_tokens, queued_attention_work=msg.queued_attention_work,
                  kv_blocks_used=msg.kv_blocks_used,
                  kv_blocks_total=msg.kv_blocks_total, fetch_bytes_per_s=msg.fetch_bytes_per_s,
                  block_bytes=msg.block_bytes, kv_block_tokens=msg.kv_block_tokens,
                  kv_stored_bytes=msg.kv_stored_bytes, kv_stored_blocks=msg.kv_stored_blocks,
                  kv_moved_bytes=msg.kv_moved_bytes, kv_moved_tokens=msg.kv_moved_tokens,
                  kv_saved_bytes=msg.kv_saved_bytes, max_num_seqs=msg.max_num_seqs,
                  max_batched_tokens=msg.max_batched_tokens,
                  pipeline_min_tokens=msg.pipeline_min_tokens, pipeline_row_bytes=msg.pipeline_row_bytes)
    for request_id in msg.request_ids:
        _request_id(msg.KIND, request_id)
    for member in msg.pipeline_group:
        _token(msg.KIND, "pipeline_group", member)
    group = msg.pipeline_group
    _require(not group or (len(set(group)) == len(group) > 1 and msg.instance_id in group), msg.KIND,
             "a pipeline group of fewer than two distinct instances, or not its sender's")
    namespace = msg.pipeline_namespace
    _require(len(namespace) <= MAX_NAMESPACE_CHARS and namespace.isascii() and namespace.isprintable(), msg.KIND,
             f"a pipeline namespace that is not at most {MAX_NAMESPACE_CHARS} printable ASCII characters")
    ok = all(len(s) == 3 and all(math.isfinite(v) and v >= 0 for v in s) for s in msg.samples + msg.prefill_samples)
    _require(ok, msg.KIND, "a step sample that is not three finite, non-negative numbers")


@invariants(KvEvent)
def _kv_event(msg: KvEvent) -> None:
    _token(msg.KIND, "instance_id", msg.instance_id)
    _require(msg.kind in KV_EVENT_KINDS, msg.KIND, f"unknown kind {msg.kind[:40]!r}")
    _non_negative(msg.KIND, seq=msg.seq)
    _hashes(msg.KIND, msg.block_hashes)


@invariants(SnapshotRequest)
def _snapshot_request(msg: SnapshotRequest) -> None:
    _token(msg.KIND, "instance_id", msg.instance_id)


@invariants(Snapshot)
def _snapshot(msg: Snapshot) -> None:
    _token(msg.KIND, "instance_id", msg.instance_id)
    _require(msg.seq >= -1, msg.KIND, f"seq {msg.seq}")
    _hashes(msg.KIND, msg.block_hashes)


@invariants(BlockPut)
def _block_put(msg: BlockPut) -> None:
    _hashes(msg.KIND, [msg.block_hash])
    _part(msg.KIND, msg.seq, msg.total)
    _non_negative(msg.KIND, raw_size=msg.raw_size)
    _require(0 <= msg.checksum < U64, msg.KIND, "checksum outside 64 bits")
    _require(len(msg.tag) in (0, TAG_BYTES), msg.KIND, f"a tag of {len(msg.tag)} bytes")


@invariants(BlockGet)
def _block_get(msg: BlockGet) -> None:
    _hashes(msg.KIND, [msg.block_hash])
    _require(0 <= msg.seq < MAX_PARTS, msg.KIND, f"part {msg.seq}")


@invariants(BlockPart)
def _block_part(msg: BlockPart) -> None:
    _hashes(msg.KIND, [msg.block_hash])
    if msg.found:
        _part(msg.KIND, msg.seq, msg.total)
        _non_negative(msg.KIND, raw_size=msg.raw_size)
        _require(len(msg.tag) in (0, TAG_BYTES), msg.KIND, f"a tag of {len(msg.tag)} bytes")


@invariants(BlockHas)
def _block_has(msg: BlockHas) -> None:
    _hashes(msg.KIND, msg.block_hashes)
