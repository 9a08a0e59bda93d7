"""A kvquant pool on the Triton backend: full blocks packed by the quantize-and-pack kernel, decode tokens attended by
the fused decode kernel (`kernels.kvquant_pack`, `kernels.kvquant_attention`, reading the pool's rows, sinks and the
staged tails as they are).

Owns the per-layer kernel parameters of a pool and the gathering of the kernels' inputs; what each token may see is
`codec_attention`'s rule, which this reproduces exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.backend import KernelBackend
from kernels.kvquant_attention import kvquant_decode_attention
from kernels.kvquant_layout import KvQuantLayerParams, check_kernel_layout
from kernels.kvquant_pack import kvquant_pack
from kernels.layer_ops import apply_rotary_ref
from shared.engine.kv.codec.pool import CodecKvPool
from shared.kvcompress.kvquant import KvQuantCodec
from shared.model.llama import RotaryEmbedding


@dataclass(frozen=True)
class DecodeBatch:
    """A step's decode tokens as the decode kernel takes them, built once per step (`FusedDecode.batch`)."""

    tables: torch.Tensor  # int32 [batch, max packed blocks]
    num_packed: torch.Tensor  # int32 [batch]
    tail_lens: torch.Tensor  # int32 [batch]: tokens after the packed blocks (the staged row's)
    first_ids: torch.Tensor  # int64 [batch]: block 0's id, whose sink row the kernel reads (0 when none is packed)
    rows: list[int]  # each token's staged row
    packed_counts: list[int]
    tail_counts: list[int]


class FusedDecode:
    """Per-layer `KvQuantLayerParams` of a kvquant pool, built once; `encode` packs full blocks (it becomes the
    pool's encoder), `attend` runs a step's decode tokens.

    Raises:
        ValueError: the pool's codec is not kvquant, or its shape is one the kernel does not handle.
    """

    @staticmethod
    def supports(pool: CodecKvPool) -> bool:
        """Whether the kernels read `pool` (every layer's codec a kvquant one)."""
        return all(isinstance(codec, KvQuantCodec) for codec in pool.codecs)

    def __init__(self, pool: CodecKvPool, rotary: RotaryEmbedding) -> None:
        if not self.supports(pool):
            raise ValueError("the fused decode kernel reads kvquant pools only")
        self.pool = pool
        device = pool.packed.device
        self.params = [
            KvQuantLayerParams.from_tables(codec.tables, pool.block_size, rotary.cos.to(device), rotary.sin.to(device))
            for codec in pool.codecs  # type: ignore[arg-type]
        ]
        check_kernel_layout(self.params[0].layout)
        pool.encoder = self.encode

    def encode(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, starts_sequence: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Full blocks' K (before RoPE) and V [B, H, T, D] -> pool rows and, for sequence-starting blocks, sink
        rows: what the codec writes, by the pack kernel."""
        rows = kvquant_pack(k, v, self.params[layer_idx], KernelBackend.TRITON, starts_sequence=starts_sequence)
        if not starts_sequence:
            return rows, None
        sink = torch.stack([k[:, :, 0], v[:, :, 0]], dim=1).to(torch.float16)  # [B, 2, H, D]: K then V
        return rows, sink.contiguous().view(k.shape[0], -1).view(torch.uint8)

    def batch(self, views: list[tuple[list[int], int, int]], device: torch.device) -> DecodeBatch:
        """A step's decode tokens, each (packed block ids, staged row, context length), as the kernel indexes them
        (the same for every layer of the step)."""
        size = self.pool.block_size
        width = max(1, max(len(ids) for ids, _, _ in views))
        tables = torch.zeros(len(views), width, dtype=torch.int32)
        for b, (ids, _, _) in enumerate(views):
            tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        num_packed = [len(ids) for ids, _, _ in views]
        tail_lens = [context_len - len(ids) * size for ids, _, context_len in views]

        def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return DecodeBatch(
            tables.to(device), tensor(num_packed, torch.int32), tensor(tail_lens, torch.int32),
            tensor([ids[0] if ids else 0 for ids, _, _ in views], torch.long), [row for _, row, _ in views],
            num_packed, tail_lens,
        )

    def attend(
        self, layer_idx: int, q: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor, batch: DecodeBatch,
        cos: torch.Tensor, sin: torch.Tensor, scale: float, backend: KernelBackend,
    ) -> torch.Tensor:
        """q [batch, heads, D] of the batch's decode tokens; staged K (before RoPE) and V [rows, T, kv_heads, D];
        cos, sin [positions, 1, D] as the model builds them. Returns [batch, heads, D]."""
        pool = self.pool
        size, heads, dim = pool.block_size, pool.kv_heads, pool.head_dim
        tail_k = torch.zeros(len(batch.rows), heads, size, dim, dtype=q.dtype, device=q.device)
        tail_v = torch.zeros_like(tail_k)
        for b, (row, packed, length) in enumerate(zip(batch.rows, batch.packed_counts, batch.tail_counts, strict=True)):
            start = packed * size
            keys = apply_rotary_ref(staged_k[row, :length], cos[start : start + length], sin[start : start + length])
            tail_k[b, :, :length] = keys.transpose(0, 1).to(q.dtype)
            tail_v[b, :, :length] = staged_v[row, :length].transpose(0, 1).to(q.dtype)
        sink = pool.sinks[layer_idx].index_select(0, batch.first_ids).view(torch.float16).view(-1, 2, heads, dim)
        return kvquant_decode_attention(
            q.contiguous(), pool.packed[layer_idx], batch.tables, batch.num_packed, tail_k, tail_v, batch.tail_lens,
            sink[:, 0], sink[:, 1], self.params[layer_idx], scale, backend,
        )
