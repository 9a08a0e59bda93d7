"""Attention over the paged pool: where each token's K/V goes and what each query may see (`StepMetadata`, built
once a step by `step_metadata` and shared by every layer), and the model's `AttentionContext` over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.backend import KernelBackend
from kernels.paged_attention import (
    decode_takes_reference,
    fresh_prefill_attention_ref,
    paged_decode_attention,
    paged_prefill_attention,
    paged_prefill_attention_padded_ref,
    store_kv,
)
from kernels.paged_attention_cpu import paged_prefill_attention_cpu
from shared.engine.kv.paged.pool import KVPool
from shared.engine.kv.store import LayerCallback

if TYPE_CHECKING:
    from shared.engine.batching import ScheduledChunk


@dataclass(frozen=True)
class PrefillSegment:
    """A run of >1 new tokens of one sequence inside the step's flat token list."""

    start: int  # first row in the step's token list
    num_tokens: int
    context_len: int  # tokens visible after this chunk (cached + earlier chunks + this one)
    block_table: torch.Tensor  # [num_blocks_of_seq]
    # A whole prompt with nothing before it, where prefill takes the reference: it attends over the step's own k, v
    # (what the pool holds for it), not over a gather from the pool. The kernels read the pool in place.
    own_kv: bool = False


@dataclass(frozen=True)
class KernelPrefill:
    """Every prefill segment of the step for one call of the CPU kernel (`paged_prefill_attention_cpu`)."""

    block_tables: torch.Tensor  # int32 [num_segments, max_blocks]
    context_lens: torch.Tensor  # int32 [num_segments]
    query_starts: torch.Tensor  # int32 [num_segments + 1]: segment s is rows [starts[s], starts[s + 1]) of the prefill


@dataclass(frozen=True)
class PaddedPrefill:
    """Every prefill segment of the step attended in one padded call (chosen when lengths are alike)."""

    block_tables: torch.Tensor  # [num_segments, max_blocks]
    num_new: list[int]
    context_lens: list[int]

    @staticmethod
    def is_worth_it(segments: list[PrefillSegment], block_size: int) -> bool:
        """True when padding to the longest segment wastes at most a quarter of the attention work."""
        if len(segments) < 2:
            return False
        max_keys = max(-(-s.context_len // block_size) for s in segments) * block_size
        padded = len(segments) * max(s.num_tokens for s in segments) * max_keys
        return padded <= 1.25 * sum(s.num_tokens * s.context_len for s in segments)


@dataclass(frozen=True)
class StepMetadata:
    """Where each token's K/V goes and what each query may see; shared by all layers of one step."""

    slot_mapping: torch.Tensor  # [num_tokens] flat pool slot of each token
    num_decode_tokens: int  # rows [0, num_decode_tokens) are single-token sequences
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_blocks]
    decode_context_lens: torch.Tensor  # [num_decode_tokens]
    prefill_segments: list[PrefillSegment]
    padded_prefill: PaddedPrefill | None = None
    own_kv_prefill: bool = False  # every segment `own_kv`, all of one length: one attention call for them all
    kernel_prefill: KernelPrefill | None = None  # set: the CPU kernel attends for every segment in one call


class PagedAttention:
    """The model's `AttentionContext` for one step: store this step's K/V, then attend over the pool.

    Per layer: store the step's K/V, `before_layer(layer_idx)` (may block until K/V loaded from outside is in the
    pool), `after_layer(layer_idx)` (every K/V this layer attends over is in place), then attend.
    """

    def __init__(
        self, pool: KVPool, meta: StepMetadata, scale: float, backend: KernelBackend,
        after_layer: LayerCallback | None = None, before_layer: LayerCallback | None = None,
    ) -> None:
        self.pool, self.meta, self.scale, self.backend = pool, meta, scale, backend
        self.after_layer, self.before_layer = after_layer, before_layer
        # Only the reference path gathers; the Triton and C++ kernels read the pool in place.
        gathers = decode_takes_reference(backend, pool.tensor.shape[-1])
        self.workspace = pool.gather_workspace(meta.decode_block_tables.numel()) if gathers else None

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        meta, backend = self.meta, self.backend
        k_cache, v_cache = self.pool.layer(layer_idx)
        store_kv(k_cache, v_cache, k, v, meta.slot_mapping, backend)
        if self.before_layer is not None:
            self.before_layer(layer_idx)
        if self.after_layer is not None:
            self.after_layer(layer_idx)
        num_decode = meta.num_decode_tokens
        if not meta.prefill_segments:
            return self._decode(q, k_cache, v_cache)
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = self._decode(q[:num_decode], k_cache, v_cache)
        if meta.kernel_prefill is not None:
            chunks = meta.kernel_prefill
            out[num_decode:] = paged_prefill_attention_cpu(
                q[num_decode:], k_cache, v_cache, chunks.block_tables, chunks.context_lens, chunks.query_starts,
                self.scale,
            )
            return out
        if meta.own_kv_prefill:
            rows = slice(num_decode, None)
            out[rows] = fresh_prefill_attention_ref(q[rows], k[rows], v[rows], len(meta.prefill_segments), self.scale)
            return out
        if meta.padded_prefill is not None:
            batch = meta.padded_prefill
            out[num_decode:] = paged_prefill_attention_padded_ref(
                q[num_decode:], k_cache, v_cache, batch.block_tables, batch.num_new, batch.context_lens, self.scale
            )
            return out
        for seg in meta.prefill_segments:
            rows = slice(seg.start, seg.start + seg.num_tokens)
            if seg.own_kv:
                out[rows] = fresh_prefill_attention_ref(q[rows], k[rows], v[rows], 1, self.scale)
                continue
            out[rows] = paged_prefill_attention(
                q[rows], k_cache, v_cache, seg.block_table, seg.context_len, self.scale, backend
            )
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        return paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale, self.backend,
            self.workspace,
        )


def step_metadata(
    chunks: list[ScheduledChunk], block_tables: dict[str, list[int]], block_size: int, backend: KernelBackend,
    device: torch.device, prefill_kernel: bool = False,
) -> StepMetadata:
    """Where a step's tokens go and what they see, chunks in the step's token order (single tokens first);
    `prefill_kernel`: prefill attention takes the CPU kernel (`prefill_takes_cpu_kernel`)."""

    def tensor(values: list[int] | list[list[int]], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    slots: list[int] = []
    for chunk in chunks:
        start, table = chunk.seq.num_computed_tokens, block_tables[chunk.seq.request_id]
        slots.extend(table[p // block_size] * block_size + p % block_size
                     for p in range(start, start + chunk.num_tokens))
    decode = [c for c in chunks if c.num_tokens == 1]
    tables = [block_tables[c.seq.request_id] for c in decode]
    width = max((len(t) for t in tables), default=1)
    padded = [t + [0] * (width - len(t)) for t in tables] or [[0]]
    segments: list[PrefillSegment] = []
    row, takes_reference = len(decode), backend is not KernelBackend.TRITON and not prefill_kernel
    for chunk in chunks[len(decode) :]:
        context_len = chunk.seq.num_computed_tokens + chunk.num_tokens
        own_kv = takes_reference and chunk.seq.num_computed_tokens == 0
        segments.append(PrefillSegment(row, chunk.num_tokens, context_len, tensor(block_tables[chunk.seq.request_id]),
                                       own_kv))
        row += chunk.num_tokens
    own_kv_prefill = bool(segments) and all(s.own_kv and s.num_tokens == segments[0].num_tokens for s in segments)

    def prefill_tables(dtype: torch.dtype) -> torch.Tensor:  # each segment's blocks up to its context, padded alike
        tables = [block_tables[c.seq.request_id][: -(-s.context_len // block_size)]
                  for c, s in zip(chunks[len(decode) :], segments, strict=True)]
        longest = max(len(t) for t in tables)
        return tensor([t + [t[0]] * (longest - len(t)) for t in tables], dtype)

    padded_prefill = None  # where prefill takes the reference, batch the step's prefill attention when chunks are alike
    if takes_reference and not own_kv_prefill and PaddedPrefill.is_worth_it(segments, block_size):
        padded_prefill = PaddedPrefill(
            block_tables=prefill_tables(torch.long),
            num_new=[s.num_tokens for s in segments],
            context_lens=[s.context_len for s in segments],
        )
    kernel_prefill = None
    if prefill_kernel and segments:
        kernel_prefill = KernelPrefill(
            block_tables=prefill_tables(torch.int32),
            context_lens=tensor([s.context_len for s in segments], torch.int32),
            query_starts=tensor([s.start - len(decode) for s in segments] + [row - len(decode)], torch.int32),
        )
    return StepMetadata(
        kernel_prefill=kernel_prefill,
        padded_prefill=padded_prefill,
        own_kv_prefill=own_kv_prefill,
        slot_mapping=tensor(slots),
        num_decode_tokens=len(decode),
        decode_block_tables=tensor(padded, torch.int32),
        decode_context_lens=tensor([c.seq.num_computed_tokens + 1 for c in decode], torch.int32),
        prefill_segments=segments,
    )
