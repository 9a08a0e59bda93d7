"""Attention over one dense window as the engine sees it when its KV cache goes through a codec.

Owns the block visibility rule and `DenseCodecAttention`: a query sees every full block before its own encoded and
decoded by the layer's codec, and its own block (the engine's last, partial one: KIVI's full-precision window)
exactly. The codecs are `shared.kvcompress.registry`'s, the figures `kv`'s; the engine's paged version is
`shared.engine`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.layer_ops import apply_rotary_ref
from shared.kvcompress.codec import KvCodec
from shared.kvcompress.kvquant import KvQuantCodec
from shared.model.llama import RotaryEmbedding


def block_visibility(num_tokens: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys each query sees, and how: (coded, exact), bool [num_tokens (query), num_tokens (key)] each.

    coded[i, j]: key j lies in a block before query i's block (always a full block), so i sees it decoded.
    exact[i, j]: key j lies in i's own block at or before i, so i sees it in full precision.
    Every other pair is masked (the future). No pair is both.
    """
    position = torch.arange(num_tokens)
    block = position // block_size
    coded = block[None, :] < block[:, None]
    exact = (block[None, :] == block[:, None]) & (position[None, :] <= position[:, None])
    return coded, exact


def round_trip_blocks(codec: KvCodec, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a sequence's first B full blocks, encoded and decoded; block 0 with starts_sequence=True.

    Args:
        k, v: [B, kv_heads, block_size, head_dim]; k before RoPE if `codec.keys_before_rope`.
    Returns:
        Decoded K and V in the same shape and dtype (K unrotated if `codec.keys_before_rope`).
    """
    num_blocks, kv_heads, block_size, head_dim = k.shape
    if isinstance(codec, KvQuantCodec):  # batched tensors, the same arithmetic as its bytes
        k_out, v_out = _kvquant_round_trip(codec, k[:1], v[:1], starts_sequence=True)
        if num_blocks > 1:
            k_rest, v_rest = _kvquant_round_trip(codec, k[1:], v[1:], starts_sequence=False)
            k_out, v_out = torch.cat([k_out, k_rest]), torch.cat([v_out, v_rest])
        return k_out.to(k.dtype), v_out.to(v.dtype)
    decoded = [
        codec.decode(
            codec.encode(k[b], v[b], starts_sequence=b == 0), kv_heads, block_size, head_dim, k.dtype,
            starts_sequence=b == 0,
        )
        for b in range(num_blocks)
    ]
    return torch.stack([kb for kb, _ in decoded]), torch.stack([vb for _, vb in decoded])


def _kvquant_round_trip(
    codec: KvQuantCodec, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    _, kv_heads, block_size, head_dim = k.shape
    packed = codec.encode_blocks(k, v, starts_sequence=starts_sequence)
    return codec.decode_blocks(packed, kv_heads, block_size, head_dim)


class DenseCodecAttention:
    """An `AttentionContext` for one sequence at positions 0..num_tokens-1, its KV seen through per-layer codecs.

    Args:
        codecs: one codec per layer (`registry.layer_codecs`).
        block_size: tokens per KV block.
        rotary: the model's RoPE tables, to rotate keys that a `keys_before_rope` codec returns unrotated.
    """

    def __init__(self, codecs: Sequence[KvCodec], block_size: int, rotary: RotaryEmbedding) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.codecs, self.block_size, self.rotary = list(codecs), block_size, rotary
        # The last `block_visibility`: every layer of a pass shares it.
        self._visibility: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v, k_pre_rope: [num_tokens, num_kv_heads, head_dim].

        Returns [num_tokens, num_heads, head_dim].
        """
        num_tokens = q.shape[0]
        # Full blocks that some query sees decoded: every block before the last query's block.
        num_coded = (num_tokens - 1) // self.block_size * self.block_size
        k_coded, v_coded = self._decoded(self.codecs[layer_idx], k, v, k_pre_rope, num_coded)
        if self._visibility is None or self._visibility[0].shape[0] != num_tokens:
            coded, exact = block_visibility(num_tokens, self.block_size)
            self._visibility = coded.to(q.device), exact.to(q.device)
        return mixed_attention(q, (k, v), (k_coded, v_coded), self.block_size, self._visibility)

    def _decoded(
        self, codec: KvCodec, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor, num_coded: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first num_coded tokens' K (rotated) and V through the codec: [num_coded, num_kv_heads, head_dim]."""
        _, kv_heads, head_dim = k.shape
        num_blocks = num_coded // self.block_size
        if not num_blocks:
            return k[:0], v[:0]
        keys = k_pre_rope if codec.keys_before_rope else k

        def as_blocks(x: torch.Tensor) -> torch.Tensor:  # [num_coded, H, D] -> [B, H, block_size, D]
            return x[:num_coded].reshape(num_blocks, self.block_size, kv_heads, head_dim).transpose(1, 2)

        def as_tokens(x: torch.Tensor) -> torch.Tensor:  # the inverse
            return x.transpose(1, 2).reshape(num_coded, kv_heads, head_dim)

        k_blocks, v_blocks = round_trip_blocks(codec, as_blocks(keys), as_blocks(v))
        k_out, v_out = as_tokens(k_blocks).to(k.device), as_tokens(v_blocks).to(v.device)
        if codec.keys_before_rope:
            positions = torch.arange(num_coded, device=self.rotary.cos.device)
            cos, sin = self.rotary.cos_sin(positions, k.dtype)
            k_out = apply_rotary_ref(k_out, cos.to(k.device), sin.to(k.device))
        return k_out, v_out


def mixed_attention(
    q: torch.Tensor, exact_kv: tuple[torch.Tensor, torch.Tensor], coded_kv: tuple[torch.Tensor, torch.Tensor],
    block_size: int, visibility: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Softmax attention where each query reads the decoded keys of the blocks before its own and the exact keys of
    its own block, one query block at a time (so no query pays for keys it cannot see).

    Args:
        q: [T, num_heads, D]; exact_kv: K, V [T, num_kv_heads, D]; coded_kv: K, V [C, num_kv_heads, D], the first C
            tokens decoded, C covering every block before the last query's. Query head h reads KV head
            h // (num_heads / num_kv_heads), as in GQA.
        visibility: `block_visibility(T, block_size)`.
    Returns:
        [T, num_heads, D].
    """
    num_tokens = q.shape[0]
    coded, exact = visibility
    queries = q.transpose(0, 1)  # [num_heads, T, D]
    k, v = (x.transpose(0, 1) for x in exact_kv)  # [num_kv_heads, T, D]
    k_coded, v_coded = (x.transpose(0, 1) for x in coded_kv)  # [num_kv_heads, C, D]
    outs = []
    for start in range(0, num_tokens, block_size):
        end = min(start + block_size, num_tokens)
        keys = torch.cat([k_coded[:, :start], k[:, start:end]], dim=1)
        values = torch.cat([v_coded[:, :start], v[:, start:end]], dim=1)
        mask = torch.cat([coded[start:end, :start], exact[start:end, start:end]], dim=1)
        outs.append(F.scaled_dot_product_attention(
            queries[:, start:end], keys, values, attn_mask=mask, enable_gqa=True
        ))
    return torch.cat(outs, dim=1).transpose(0, 1)
