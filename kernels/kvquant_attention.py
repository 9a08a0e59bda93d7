"""Decode attention over a kvquant-packed KV cache: the plain PyTorch reference and the dispatcher.

A sequence's context is its packed full blocks (pool rows, `kernels.kvquant_layout`; keys stored before RoPE), its
attention sink kept whole in fp16 and its fp16 tail (the partial block, keys already rotated). The fused Triton
kernel that reads the packed rows directly is `kernels.kvquant_attention_triton`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.backend import KernelBackend
from kernels.kvquant_attention_triton import kvquant_decode_attention_triton
from kernels.kvquant_format import decode_blocks, from_rows
from kernels.kvquant_layout import KvQuantLayerParams


def rotate_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """k [H, num_tokens, D] at positions 0..num_tokens-1, rotated as `kernels.layer_ops.apply_rotary_ref` does."""
    num_tokens, half = k.shape[1], k.shape[2] // 2
    cos_t, sin_t = cos[:num_tokens].repeat(1, 2), sin[:num_tokens].repeat(1, 2)  # [num_tokens, D]
    rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return k * cos_t + rotated * sin_t


def decode_packed_blocks(rows: torch.Tensor, params: KvQuantLayerParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool rows uint8 [B, bytes_per_block] -> K (before RoPE) and V fp32 [B, H, T, D], by the format's decode (the
    codec's own)."""
    layout = params.layout
    shape = (layout.kv_heads, layout.block_size, layout.head_dim)
    return decode_blocks(params.tables, from_rows(params.tables, rows.contiguous(), None, *shape), *shape)


def kvquant_decode_attention_ref(
    q: torch.Tensor, packed_pool: torch.Tensor, block_tables: torch.Tensor, num_packed_blocks: torch.Tensor,
    tail_k: torch.Tensor, tail_v: torch.Tensor, tail_lens: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor,
    params: KvQuantLayerParams, scale: float,
) -> torch.Tensor:
    """One query token per sequence over its packed blocks, sink and fp16 tail.

    Sequence b sees positions 0..P-1 (P = num_packed_blocks[b] * T) from its first num_packed_blocks[b] blocks in
    block_tables[b], token 0 replaced by its sink when P > 0, then positions P..P+tail_lens[b]-1 from its tail.

    Args:
        q: [batch, num_heads, D], rotated; num_heads a multiple of the layout's KV heads H (GQA).
        packed_pool: uint8 [num_blocks, bytes_per_block], one layer's pool rows.
        block_tables: [batch, max_blocks] int; entries past num_packed_blocks[b] are ignored.
        num_packed_blocks, tail_lens: [batch] int; tail_lens[b] <= T; every sequence sees at least one token.
        tail_k, tail_v: [batch, H, T, D] in q's dtype, keys rotated.
        sink_k, sink_v: [batch, H, D], token 0's K (unrotated, which at position 0 is rotated) and V.
        params: the layer's `KvQuantLayerParams` (cos/sin must cover every packed position).
    Returns:
        [batch, num_heads, D] in q's dtype, computed in fp32.
    Raises:
        ValueError: a sequence without any token.
    """
    outputs = []
    for b in range(q.shape[0]):
        num_packed, tail_len = int(num_packed_blocks[b]), int(tail_lens[b])
        if num_packed + tail_len == 0:
            raise ValueError(f"sequence {b} has no token to attend to")
        k, v = _sequence_kv(packed_pool, block_tables[b, :num_packed], params)  # [H, P, D] fp32
        if num_packed:
            k[:, 0], v[:, 0] = sink_k[b].float(), sink_v[b].float()
        k = rotate_keys(k, params.cos, params.sin)
        k = torch.cat([k, tail_k[b, :, :tail_len].float()], dim=1)
        v = torch.cat([v, tail_v[b, :, :tail_len].float()], dim=1)
        out = F.scaled_dot_product_attention(
            q[b, :, None].float(), k, v, scale=scale, enable_gqa=True
        )  # [num_heads, 1, D]
        outputs.append(out[:, 0])
    return torch.stack(outputs).to(q.dtype)


def _sequence_kv(
    packed_pool: torch.Tensor, block_ids: torch.Tensor, params: KvQuantLayerParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """K (before RoPE) and V fp32 [H, len(block_ids) * T, D] of the listed blocks, in order."""
    layout = params.layout
    shape = (layout.kv_heads, -1, layout.head_dim)
    if block_ids.numel() == 0:
        empty = torch.empty(shape[0], 0, shape[2], device=packed_pool.device)
        return empty, empty.clone()
    k, v = decode_packed_blocks(packed_pool[block_ids.long()], params)  # [n, H, T, D]
    return k.transpose(0, 1).reshape(shape), v.transpose(0, 1).reshape(shape)


def kvquant_decode_attention(
    q: torch.Tensor, packed_pool: torch.Tensor, block_tables: torch.Tensor, num_packed_blocks: torch.Tensor,
    tail_k: torch.Tensor, tail_v: torch.Tensor, tail_lens: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor,
    params: KvQuantLayerParams, scale: float, backend: KernelBackend,
) -> torch.Tensor:
    """`kvquant_decode_attention_ref` or its fused Triton kernel, by backend; [batch, num_heads, D]."""
    attend = kvquant_decode_attention_triton if backend is KernelBackend.TRITON else kvquant_decode_attention_ref
    return attend(
        q, packed_pool, block_tables, num_packed_blocks, tail_k, tail_v, tail_lens, sink_k, sink_v, params, scale
    )
