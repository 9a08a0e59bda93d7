"""Quantize-and-pack on append: full blocks' K (before RoPE) and V into kvquant pool rows; reference and dispatcher.

Owns the choice of value outliers (`select_outliers`, plain torch: a top-k per head, as the codec ranks them; keys
have none) and `kvquant_pack_ref` (`kernels.kvquant_format.encode_blocks`, the codec's own, sections joined into
rows). A row has no sink section: the engine keeps a sequence's first token (K before RoPE, V) apart in fp16, and
`starts_sequence` only keeps it out of the value outliers and the key ranges, as the codec does. The fused Triton
kernel is `kernels.kvquant_pack_triton`; the row layout `kernels.kvquant_layout`.
"""

from __future__ import annotations

import torch

from kernels.backend import KernelBackend
from kernels.kvquant_format import encode_blocks, to_rows, value_rank
from kernels.kvquant_layout import KvQuantLayerParams
from kernels.kvquant_pack_triton import kvquant_pack_triton


def select_outliers(v: torch.Tensor, params: KvQuantLayerParams, *, starts_sequence: bool = False) -> torch.Tensor:
    """Per (block, KV head), the flat indices t * D + d of the n value outliers, ascending.

    The codec's ranking (`kernels.kvquant_format.value_rank`); with `starts_sequence` (every block) token 0, the
    sink, is never an outlier.
    Args:
        v: [B, H, T, D].
    Returns:
        int64 [B, H, n].
    """
    rank = value_rank(v, starts_sequence)
    n = params.layout.num_outliers
    if not n:
        return torch.empty(*rank.shape[:2], 0, dtype=torch.int64, device=rank.device)
    return rank.flatten(2).topk(n, dim=2).indices.sort(dim=2).values


def kvquant_pack_ref(
    k: torch.Tensor, v: torch.Tensor, params: KvQuantLayerParams, *, starts_sequence: bool = False
) -> torch.Tensor:
    """Full blocks' k (before RoPE), v [B, H, T, D] -> pool rows uint8 [B, bytes_per_block], by the codec.

    With `starts_sequence` the rows are the codec's bytes of sequence-starting blocks less the sink section (token 0
    is then never a value outlier and sits in no key range); the kernels read either kind alike.
    """
    rows, _ = to_rows(encode_blocks(params.tables, k, v, starts_sequence=starts_sequence))
    return rows


def kvquant_pack(
    k: torch.Tensor, v: torch.Tensor, params: KvQuantLayerParams, backend: KernelBackend, *,
    starts_sequence: bool = False,
) -> torch.Tensor:
    """`kvquant_pack_ref`, or `select_outliers` then the fused Triton kernel, by backend; uint8 [B, bytes]."""
    if backend is KernelBackend.TRITON:
        v_index = select_outliers(v, params, starts_sequence=starts_sequence)
        return kvquant_pack_triton(k, v, v_index, params, starts_sequence=starts_sequence)
    return kvquant_pack_ref(k, v, params, starts_sequence=starts_sequence)
