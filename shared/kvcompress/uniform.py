"""The uniform codecs: `fp16` (the baseline), `int8` per token, and KIVI's `kivi-4` / `kivi-2`.

Owns their byte layouts; the quantizer arithmetic is `quantize`, the bit layout `bitpack`. Calibrated, non-uniform
codecs (KVQuant) live elsewhere. These codecs store a sequence's first block like any other (`starts_sequence` is
accepted and ignored).
"""

from __future__ import annotations

import torch

from kernels.bitpack import pack_codes, packed_num_bytes, unpack_codes
from shared.kvcompress.codec import KvCodec, check_dims, check_kv, split_bytes, to_bytes
from shared.kvcompress.quantize import (
    dequantize_asymmetric,
    dequantize_symmetric_int8,
    quantize_asymmetric,
    quantize_symmetric_int8,
)

_FP16_BYTES = 2


class Fp16Codec(KvCodec):
    """K then V as fp16, [kv_heads, num_tokens, head_dim] each: lossless for fp16 input, 16 bits per element."""

    name = "fp16"

    def encode(self, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool = False) -> bytes:
        check_kv(k, v)
        return to_bytes(k.to(torch.float16), v.to(torch.float16))

    def decode(
        self, data: bytes, kv_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype, *,
        starts_sequence: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_dims(kv_heads, num_tokens, head_dim)
        shape = (kv_heads, num_tokens, head_dim)
        count = kv_heads * num_tokens * head_dim
        k, v = split_bytes(self, data, [(torch.float16, count), (torch.float16, count)])
        return k.view(shape).to(dtype), v.view(shape).to(dtype)

    def num_bytes(self, kv_heads: int, num_tokens: int, head_dim: int, *, starts_sequence: bool = False) -> int:
        check_dims(kv_heads, num_tokens, head_dim)
        return 2 * kv_heads * num_tokens * head_dim * _FP16_BYTES


class Int8Codec(KvCodec):
    """Symmetric int8 per token per head, K and V alike: one fp16 scale per (head, token).

    The scale is stored as the row's absolute maximum (127 steps of absmax / 127), so the row's largest element and a
    constant row decode exactly. Layout: K codes, V codes (int8 [kv_heads, num_tokens, head_dim] each), then K and V
    absmax (fp16 [kv_heads, num_tokens] each).
    """

    name = "int8"

    def encode(self, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool = False) -> bytes:
        check_kv(k, v)
        k_codes, k_absmax = quantize_symmetric_int8(k, dim=-1)
        v_codes, v_absmax = quantize_symmetric_int8(v, dim=-1)
        return to_bytes(k_codes, v_codes, k_absmax, v_absmax)

    def decode(
        self, data: bytes, kv_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype, *,
        starts_sequence: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_dims(kv_heads, num_tokens, head_dim)
        shape = (kv_heads, num_tokens, head_dim)
        count, rows = kv_heads * num_tokens * head_dim, kv_heads * num_tokens
        k_codes, v_codes, k_absmax, v_absmax = split_bytes(
            self, data, [(torch.int8, count), (torch.int8, count), (torch.float16, rows), (torch.float16, rows)]
        )
        k = dequantize_symmetric_int8(k_codes.view(shape), k_absmax.view(kv_heads, num_tokens, 1))
        v = dequantize_symmetric_int8(v_codes.view(shape), v_absmax.view(kv_heads, num_tokens, 1))
        return k.to(dtype), v.to(dtype)

    def num_bytes(self, kv_heads: int, num_tokens: int, head_dim: int, *, starts_sequence: bool = False) -> int:
        check_dims(kv_heads, num_tokens, head_dim)
        return 2 * kv_heads * num_tokens * (head_dim + _FP16_BYTES)


class KiviCodec(KvCodec):
    """KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"), uniform b-bit.

    Keys per channel: for each (head, channel) a minimum and scale over the block's tokens (the block is KIVI's
    group along tokens). Values per token: for each (head, token) a minimum and scale per group of `group_size`
    channels (the last group shorter when head_dim is not a multiple). Asymmetric round-to-nearest, metadata in fp16.

    KIVI keeps its most recent tokens in full precision until a group fills; in tsukimi that window is the engine's
    last, not-yet-full block, so this codec is meant for full blocks and the window is the engine's business (a
    partial block still encodes, with its keys grouped over the tokens it has).

    Layout: K codes, V codes (each [kv_heads, num_tokens, head_dim] packed by `bitpack`), K minimum, K scale
    (fp16 [kv_heads, head_dim] each), V minimum, V scale (fp16 [kv_heads, num_tokens, num_groups] each).
    """

    def __init__(self, bits: int, group_size: int = 32) -> None:
        """Raises ValueError for a width `bitpack` cannot pack or a group size below 1."""
        packed_num_bytes(0, bits)
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.bits, self.group_size = bits, group_size
        self.name = f"kivi-{bits}"

    def encode(self, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool = False) -> bytes:
        check_kv(k, v)
        k_codes, k_min, k_scale = quantize_asymmetric(k, self.bits, dim=1)  # metadata [kv_heads, 1, head_dim]
        v_codes, v_min, v_scale = self._quantize_values(v)
        return to_bytes(
            pack_codes(k_codes, self.bits), pack_codes(v_codes, self.bits), k_min, k_scale, v_min, v_scale
        )

    def decode(
        self, data: bytes, kv_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype, *,
        starts_sequence: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_dims(kv_heads, num_tokens, head_dim)
        count = kv_heads * num_tokens * head_dim
        packed = packed_num_bytes(count, self.bits)
        num_groups = -(-head_dim // self.group_size)
        k_packed, v_packed, k_min, k_scale, v_min, v_scale = split_bytes(self, data, [
            (torch.uint8, packed), (torch.uint8, packed),
            (torch.float16, kv_heads * head_dim), (torch.float16, kv_heads * head_dim),
            (torch.float16, kv_heads * num_tokens * num_groups), (torch.float16, kv_heads * num_tokens * num_groups),
        ])
        shape = (kv_heads, num_tokens, head_dim)
        k_codes = unpack_codes(k_packed, count, self.bits).view(shape)
        v_codes = unpack_codes(v_packed, count, self.bits).view(shape)
        key_meta = (kv_heads, 1, head_dim)
        k = dequantize_asymmetric(k_codes, k_min.view(key_meta), k_scale.view(key_meta))
        value_meta = (kv_heads, num_tokens, num_groups, 1)
        v = self._dequantize_values(v_codes, v_min.view(value_meta), v_scale.view(value_meta))
        return k.to(dtype), v.to(dtype)

    def num_bytes(self, kv_heads: int, num_tokens: int, head_dim: int, *, starts_sequence: bool = False) -> int:
        check_dims(kv_heads, num_tokens, head_dim)
        codes = 2 * packed_num_bytes(kv_heads * num_tokens * head_dim, self.bits)
        key_meta = 2 * kv_heads * head_dim * _FP16_BYTES
        value_meta = 2 * kv_heads * num_tokens * -(-head_dim // self.group_size) * _FP16_BYTES
        return codes + key_meta + value_meta

    def _quantize_values(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes [kv_heads, num_tokens, head_dim]; minimum, scale [kv_heads, num_tokens, num_groups, 1]."""
        kv_heads, num_tokens, head_dim = v.shape
        num_groups = -(-head_dim // self.group_size)
        pad = num_groups * self.group_size - head_dim
        # Pad a short last group with copies of its last channel: its minimum and maximum stay the real ones.
        padded = torch.cat([v, v[:, :, -1:].expand(-1, -1, pad)], dim=2) if pad else v
        grouped = padded.reshape(kv_heads, num_tokens, num_groups, self.group_size)
        codes, minimum, scale = quantize_asymmetric(grouped, self.bits, dim=-1)
        return codes.reshape(kv_heads, num_tokens, -1)[:, :, :head_dim], minimum, scale

    def _dequantize_values(self, codes: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        kv_heads, num_tokens, head_dim = codes.shape
        num_groups = minimum.shape[2]
        padded = codes.new_zeros(kv_heads, num_tokens, num_groups * self.group_size)
        padded[:, :, :head_dim] = codes
        grouped = padded.view(kv_heads, num_tokens, num_groups, self.group_size)
        return dequantize_asymmetric(grouped, minimum, scale).reshape(kv_heads, num_tokens, -1)[:, :, :head_dim]
