"""Attention over a `CodecKvPool`: where a step's new K/V go, which blocks get encoded, and what each query sees.

Owns the per-step layout (`CodecStepLayout`, built once and shared by every layer) and the model's
`AttentionContext` for codec pools. Per layer, the blocks a step touches are staged in full precision (a tail's
earlier tokens, then the new ones); blocks that fill up are encoded into the pool, a partial last block goes back to
its tail. Queries attend over their sequence's earlier blocks decoded from the pool (keys rotated after decoding when
the codec stores them before RoPE) and over the staged blocks in full precision: a decode token sees its own block
exact, as KIVI's window does, and a prefill chunk attends to itself in full precision, as KVQuant's prefill does.
This is the plain PyTorch path (dequantize, then attend); a fused kernel reads the pool directly on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backend import KernelBackend
from kernels.layer_ops import apply_rotary_ref
from shared.engine.batching import ScheduledChunk
from shared.engine.kv.codec.fused_decode import DecodeBatch, FusedDecode
from shared.engine.kv.codec.pool import CodecKvPool
from shared.engine.kv.store import LayerCallback
from shared.model.llama import RotaryEmbedding


@dataclass(frozen=True)
class ChunkView:
    """One sequence's part of the step."""

    first_query: int  # row of its first new token in the step's token list
    num_tokens: int  # new tokens (1 for a decode step)
    context_len: int  # tokens visible to its last query
    packed_ids: list[int]  # blocks completed before this step, read from the pool
    first_row: int  # staged row of its first touched block
    num_rows: int


@dataclass(frozen=True)
class CodecStepLayout:
    """Where every new token goes and what every query reads, for all layers of one step."""

    num_rows: int
    token_index: torch.Tensor  # [num_tokens]: flat staged slot (row * block_size + offset) of each new token
    prefix_rows: torch.Tensor  # staged rows that begin with tokens from a tail ...
    prefix_tails: torch.Tensor  # ... and those tails
    complete_rows: list[int]  # staged rows whose block fills up this step ...
    complete_ids: list[int]  # ... their block ids
    complete_first: list[bool]  # ... and whether each is a sequence's first block
    partial_rows: torch.Tensor  # staged rows left partial ...
    partial_tails: torch.Tensor  # ... and the tails they go back to
    chunks: list[ChunkView]

    @staticmethod
    def build(
        chunks: list[ScheduledChunk], block_tables: dict[str, list[int]], pool: CodecKvPool, device: torch.device
    ) -> CodecStepLayout:
        """Lay out a step (chunks in the step's token order).

        Raises:
            OutOfTails: more sequences hold a partial block than the pool has tails.
        """
        size = pool.block_size
        token_index: list[int] = []
        prefix_rows, prefix_tails, partial_rows, partial_tails = [], [], [], []
        complete_rows, complete_ids, complete_first = [], [], []
        views: list[ChunkView] = []
        row = query = 0
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_tokens
            table = block_tables[seq.request_id]
            first_block, last_block = start // size, (end - 1) // size
            if start % size:
                prefix_rows.append(row)
                prefix_tails.append(pool.tail(seq.request_id))
            token_index.extend((row + p // size - first_block) * size + p % size for p in range(start, end))
            for block in range(first_block, last_block + 1):
                block_row = row + block - first_block
                if (block + 1) * size <= end:
                    complete_rows.append(block_row)
                    complete_ids.append(table[block])
                    complete_first.append(block == 0)
                else:
                    partial_rows.append(block_row)
                    partial_tails.append(pool.tail(seq.request_id))
            num_rows = last_block - first_block + 1
            views.append(ChunkView(query, chunk.num_tokens, end, table[:first_block], row, num_rows))
            row += num_rows
            query += chunk.num_tokens

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return CodecStepLayout(
            row, tensor(token_index), tensor(prefix_rows), tensor(prefix_tails), complete_rows, complete_ids,
            complete_first, tensor(partial_rows), tensor(partial_tails), views,
        )


class CodecAttention:
    """The model's `AttentionContext` for one step over a `CodecKvPool`.

    Per layer: stage the step's K/V, encode the blocks that fill up, keep partial ones in their tails,
    `before_layer`, `after_layer`, then attend.
    """

    def __init__(
        self, pool: CodecKvPool, layout: CodecStepLayout, scale: float, rotary: RotaryEmbedding,
        after_layer: LayerCallback | None = None, before_layer: LayerCallback | None = None,
        fused: FusedDecode | None = None, backend: KernelBackend = KernelBackend.TORCH,
    ) -> None:
        self.pool, self.layout, self.scale, self.rotary = pool, layout, scale, rotary
        self.after_layer, self.before_layer = after_layer, before_layer
        self.fused, self.backend = fused, backend  # with `fused`, decode tokens go through the fused kernel
        self.decodes: tuple[torch.Tensor, DecodeBatch] | None = None  # their query rows and kernel batch
        decodes = [view for view in layout.chunks if view.num_tokens == 1]
        if fused is not None and decodes:
            device = pool.tails.device
            rows = torch.tensor([view.first_query for view in decodes], dtype=torch.long, device=device)
            batch = fused.batch([(view.packed_ids, view.first_row, view.context_len) for view in decodes], device)
            self.decodes = (rows, batch)
        longest = max((view.context_len for view in layout.chunks), default=0)  # none: a step of FastGen lanes
        self.cos, self.sin = rotary.cos_sin(torch.arange(longest, device=pool.tails.device), pool.dtype)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        pool = self.pool
        staged_k, staged_v = self._store(layer_idx, k_pre_rope if pool.keys_before_rope else k, v)
        if self.before_layer is not None:
            self.before_layer(layer_idx)
        if self.after_layer is not None:
            self.after_layer(layer_idx)
        out = torch.empty_like(q)
        views = self.layout.chunks
        if self.fused is not None and self.decodes is not None:
            decode_rows, batch = self.decodes
            out[decode_rows] = self.fused.attend(
                layer_idx, q[decode_rows], staged_k, staged_v, batch, self.cos, self.sin, self.scale, self.backend
            )
            views = [view for view in views if view.num_tokens > 1]
        packed_ids = [i for view in views for i in view.packed_ids]
        first = [j == 0 for view in views for j in range(len(view.packed_ids))]
        decoded_k, decoded_v = pool.decode_blocks(layer_idx, packed_ids, first) if packed_ids else (None, None)
        block = 0
        for view in views:
            rows = slice(view.first_row, view.first_row + view.num_rows)
            parts_k, parts_v = [staged_k[rows].flatten(0, 1)], [staged_v[rows].flatten(0, 1)]
            if view.packed_ids and decoded_k is not None and decoded_v is not None:
                blocks = slice(block, block + len(view.packed_ids))
                # [n, H, T, D] -> [n * T, H, D], ahead of the staged rows
                parts_k.insert(0, decoded_k[blocks].transpose(1, 2).flatten(0, 1))
                parts_v.insert(0, decoded_v[blocks].transpose(1, 2).flatten(0, 1))
                block += len(view.packed_ids)
            keys = torch.cat(parts_k)[: view.context_len]
            values = torch.cat(parts_v)[: view.context_len]
            if pool.keys_before_rope:
                keys = apply_rotary_ref(keys, self.cos[: view.context_len], self.sin[: view.context_len])
            queries = slice(view.first_query, view.first_query + view.num_tokens)
            out[queries] = self._attend_one(q[queries], keys, values, view)
        return out

    def _store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Staged K and V, [rows, block_size, kv_heads, head_dim] each, after encoding and saving tails."""
        pool, layout = self.pool, self.layout
        size, heads, dim = pool.block_size, pool.kv_heads, pool.head_dim
        staged = []
        for index, new in enumerate((k, v)):
            rows = torch.zeros(layout.num_rows, size, heads, dim, dtype=pool.dtype, device=new.device)
            if layout.prefix_rows.numel():
                rows[layout.prefix_rows] = pool.tails[layer_idx, index, layout.prefix_tails].transpose(1, 2)
            rows.view(-1, heads, dim).index_copy_(0, layout.token_index, new.to(pool.dtype))
            if layout.partial_rows.numel():
                pool.tails[layer_idx, index, layout.partial_tails] = rows[layout.partial_rows].transpose(1, 2)
            staged.append(rows)
        if layout.complete_rows:
            complete = torch.tensor(layout.complete_rows, dtype=torch.long, device=staged[0].device)
            k_blocks, v_blocks = (s[complete].transpose(1, 2) for s in staged)
            pool.encode_blocks(layer_idx, layout.complete_ids, k_blocks, v_blocks, layout.complete_first)
        return staged[0], staged[1]

    def _attend_one(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, view: ChunkView
    ) -> torch.Tensor:
        """q [n, heads, D] over keys/values [L, kv_heads, D]; query i sits at position L - n + i."""
        mask = None
        if view.num_tokens > 1:
            positions = torch.arange(view.context_len, device=q.device)
            query_pos = positions[view.context_len - view.num_tokens :]
            mask = positions[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)
