"""A kvquant pool on the Triton backend: full blocks packed by the quantize-and-pack kernel, decode tokens attended by
the fused decode kernel (`kernels.kvquant_pack`, `kernels.kvquant_attention`, reading the pool's rows, sinks and the
staged tails as they are).

Owns the per-layer kernel parameters of a pool and the gathering of the kernels' inputs; what each token may see is
`codec_attention`'s rule, which this reproduces exactly.
"""

from __future__ import annotations

import torch

from kernels.backend import KernelBackend
from kernels.kvquant_attention import kvquant_decode_attention
from kernels.kvquant_layout import KvQuantLayerParams, check_kernel_layout
from kernels.kvquant_pack import kvquant_pack
from shared.engine.codec_pool import CodecKvPool
from shared.kvcompress.kvquant import KvQuantCodec
from shared.model.llama import RotaryEmbedding, apply_rotary


class FusedDecode:
    """Per-layer `KvQuantLayerParams` of a kvquant pool, built once; `encode` packs full blocks (it becomes the
    pool's encoder), `attend` runs a step's decode tokens.

    Raises:
        ValueError: the pool's codec is not kvquant, or its shape is one the kernel does not handle.
    """

    def __init__(self, pool: CodecKvPool, rotary: RotaryEmbedding) -> None:
        if not all(isinstance(codec, KvQuantCodec) for codec in pool.codecs):
            raise ValueError("the fused decode kernel reads kvquant pools only")
        self.pool = pool
        device = pool.packed.device
        self.params = [
            KvQuantLayerParams.from_codec(codec, pool.block_size, rotary.cos.to(device), rotary.sin.to(device))
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

    def attend(
        self, layer_idx: int, q: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor,
        views: list[tuple[list[int], int, int]], cos: torch.Tensor, sin: torch.Tensor, scale: float,
        backend: KernelBackend,
    ) -> torch.Tensor:
        """q [batch, heads, D] of decode tokens; views: (packed block ids, staged row, context length) each;
        staged K (before RoPE) and V [rows, T, kv_heads, D]; cos, sin [positions, 1, D] as the model builds them.
        Returns [batch, heads, D]."""
        pool, device = self.pool, q.device
        size, heads, dim = pool.block_size, pool.kv_heads, pool.head_dim
        batch = len(views)
        width = max(1, max(len(ids) for ids, _, _ in views))
        tables = torch.zeros(batch, width, dtype=torch.int32)
        tail_k = torch.zeros(batch, heads, size, dim, dtype=q.dtype, device=device)
        tail_v = torch.zeros_like(tail_k)
        num_packed, tail_lens, first_ids = [], [], []
        for b, (ids, row, context_len) in enumerate(views):
            tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            start, length = len(ids) * size, context_len - len(ids) * size
            keys = apply_rotary(staged_k[row, :length], cos[start:context_len], sin[start:context_len])
            tail_k[b, :, :length] = keys.transpose(0, 1).to(q.dtype)
            tail_v[b, :, :length] = staged_v[row, :length].transpose(0, 1).to(q.dtype)
            num_packed.append(len(ids))
            tail_lens.append(length)
            first_ids.append(ids[0] if ids else 0)
        sinks = pool.sinks[layer_idx].index_select(0, torch.tensor(first_ids, dtype=torch.long, device=device))
        sink = sinks.contiguous().view(torch.float16).view(batch, 2, heads, dim)
        return kvquant_decode_attention(
            q.contiguous(), pool.packed[layer_idx], tables.to(device),
            torch.tensor(num_packed, dtype=torch.int32, device=device), tail_k, tail_v,
            torch.tensor(tail_lens, dtype=torch.int32, device=device), sink[:, 0], sink[:, 1],
            self.params[layer_idx], scale, backend,
        )
