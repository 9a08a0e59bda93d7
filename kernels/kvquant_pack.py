"""Quantize-and-pack on append: full blocks' K (before RoPE) and V into kvquant pool rows; reference and dispatcher.

Owns the choice of outliers (`select_outliers`, plain torch: a top-k per head, as the codec ranks them) and
`kvquant_pack_ref` (the codec's `encode_blocks`, sections joined into rows). A row has no sink section: the engine
keeps a sequence's first token (K before RoPE, V) apart in fp16, and `starts_sequence` only keeps it out of the
outliers, as the codec does. The fused Triton kernel is `kernels.kvquant_pack_triton`; the row layout
`kernels.kvquant_layout`.
"""

from __future__ import annotations

import torch

from kernels.backend import KernelBackend
from kernels.kvquant_layout import KvQuantLayerParams
from kernels.kvquant_pack_triton import kvquant_pack_triton


def select_outliers(
    k: torch.Tensor, v: torch.Tensor, params: KvQuantLayerParams, *, starts_sequence: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (block, KV head), the flat indices t * D + d of the n key and n value outliers, ascending.

    The codec's ranking: keys by |normalised key|, values by their distance from the token's mean (over every head)
    in token standard deviations; with `starts_sequence` (every block) token 0, the sink, is never an outlier.
    Args:
        k, v: [B, H, T, D], k before RoPE.
    Returns:
        int64 [B, H, n] each.
    """
    k32, v32 = k.float(), v.float()
    center, scale = params.key_center[:, None, :], params.key_scale[:, None, :]
    k_rank = ((k32 - center) / scale).abs()
    mean = v32.mean(dim=(1, 3), keepdim=True)
    std = v32.std(dim=(1, 3), keepdim=True, correction=0).clamp_min(1e-6)
    v_rank = (v32 - mean).abs() / std
    if starts_sequence:
        k_rank[:, :, 0], v_rank[:, :, 0] = -1.0, -1.0
    return _top(k_rank, params.layout.num_outliers), _top(v_rank, params.layout.num_outliers)


def _top(rank: torch.Tensor, n: int) -> torch.Tensor:
    if not n:
        return torch.empty(*rank.shape[:2], 0, dtype=torch.int64, device=rank.device)
    return rank.flatten(2).topk(n, dim=2).indices.sort(dim=2).values


def kvquant_pack_ref(
    k: torch.Tensor, v: torch.Tensor, params: KvQuantLayerParams, *, starts_sequence: bool = False
) -> torch.Tensor:
    """Full blocks' k (before RoPE), v [B, H, T, D] -> pool rows uint8 [B, bytes_per_block], by the codec.

    With `starts_sequence` the rows are the codec's bytes of sequence-starting blocks less the sink section (token 0
    is then never an outlier); the kernels read either kind alike.
    """
    codec = params.codec()
    rows, _ = codec.to_rows(codec.encode_blocks(k, v, starts_sequence=starts_sequence))
    return rows


def kvquant_pack(
    k: torch.Tensor, v: torch.Tensor, params: KvQuantLayerParams, backend: KernelBackend, *,
    starts_sequence: bool = False,
) -> torch.Tensor:
    """`kvquant_pack_ref`, or `select_outliers` then the fused Triton kernel, by backend; uint8 [B, bytes]."""
    if backend is KernelBackend.TRITON:
        k_index, v_index = select_outliers(k, v, params, starts_sequence=starts_sequence)
        return kvquant_pack_triton(k, v, k_index, v_index, params)
    return kvquant_pack_ref(k, v, params, starts_sequence=starts_sequence)
