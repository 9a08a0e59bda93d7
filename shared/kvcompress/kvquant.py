"""KVQuant (Hooper et al. 2024, "KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache
Quantization"): non-uniform, calibrated, dense-and-sparse 2/3/4-bit codes for one layer of one KV block.

Owns `KvQuantCodec`, the `KvCodec` of one layer; the calibration it reads is `calibration`.

Keys are coded per channel and *before* RoPE (the caller rotates after decoding). Each (head, channel) has a
calibrated grid of 256 points spanning its centre +- 2 half-ranges; a block stores, per (head, channel), the grid
points just below and above its keys (uint8 each: 0.25 bit per key element at 64 tokens), and the channel's keys
are mapped from that block range to [-1, 1] and rounded to the nearest entry of the layer's key codebook. A block
range follows a channel's level within the block, which a static range cannot (measured on SmolLM2: it beats
keeping 1% of the keys as sparse outliers at fewer bits, so keys have none). Values are coded per token: one fp16
centre and half-range per token, shared by the KV heads (at head dim 64 a per-head pair would cost 0.5 bit per value
element), then the layer's value codebook. Per head, the ceil(f * tokens * head_dim) values farthest from their
token's mean (in token standard deviations) are the sparse outliers: stored as fp16 corrections to their dense
decoding at a uint16 index. The first token of a sequence (the attention sink) is kept whole in fp16, outside every
range.

The byte layout of a block and the batched arithmetic are `kernels.kvquant_format`'s, which the kernels'
references share; this module is the codec over them: calibration in, one block's bytes out and back.
"""

from __future__ import annotations

import torch

from kernels.kvquant_format import (
    KvQuantTables,
    PackedBlocks,
    decode_blocks,
    encode_blocks,
    from_rows,
    to_rows,
)
from shared.kvcompress.codec import KvCodec, KvCodecError, check_dims, check_kv
from shared.kvcompress.names import KVQUANT_BITS

_MAX_HEAD_ELEMENTS = 1 << 16  # outlier indices are uint16 within one head's [T, D]


class KvQuantCodec(KvCodec):
    """One layer's kvquant-b codec.

    Args:
        bits: 2, 3 or 4.
        key_center, key_scale: fp32 [kv_heads, head_dim], the calibrated key channel centres and half-ranges (they
            place each channel's grid, `kernels.kvquant_format.key_grid`).
        key_codebook, value_codebook: fp32 [2**bits], ascending, in normalised units (a block's range is [-1, 1]).
        outlier_fraction: share of each head's values kept as sparse fp16 corrections.
    Raises:
        ValueError: an unsupported width or codebooks of the wrong size.
    """

    def __init__(
        self, bits: int, key_center: torch.Tensor, key_scale: torch.Tensor, key_codebook: torch.Tensor,
        value_codebook: torch.Tensor, outlier_fraction: float,
    ) -> None:
        if bits not in KVQUANT_BITS:
            raise ValueError(f"kvquant codes are {KVQUANT_BITS} bits, got {bits}")
        if key_codebook.shape != (1 << bits,) or value_codebook.shape != (1 << bits,):
            raise ValueError(f"{bits}-bit codebooks need {1 << bits} entries")
        self.bits, self.name, self.outlier_fraction = bits, f"kvquant-{bits}", outlier_fraction
        self.keys_before_rope = True
        self.tables = KvQuantTables(
            bits, outlier_fraction, key_center.float().cpu(), key_scale.float().cpu(), key_codebook.float().cpu(),
            value_codebook.float().cpu(),
        )

    @property
    def key_center(self) -> torch.Tensor:
        return self.tables.key_center

    @property
    def key_scale(self) -> torch.Tensor:
        return self.tables.key_scale

    @property
    def key_codebook(self) -> torch.Tensor:
        return self.tables.key_codebook

    @property
    def value_codebook(self) -> torch.Tensor:
        return self.tables.value_codebook

    # --- the KvCodec byte interface (one block) -------------------------------------------------------------------

    def encode(self, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool = False) -> bytes:
        """`k` is the block's keys before RoPE. The bytes are `to_rows`' row, then the sink when there is one."""
        kv_heads, num_tokens, head_dim = check_kv(k, v)
        self._check_shape(kv_heads, num_tokens, head_dim)
        rows, sinks = self.to_rows(self.encode_blocks(k.unsqueeze(0), v.unsqueeze(0), starts_sequence=starts_sequence))
        data = rows[0].cpu().numpy().tobytes()
        return data if sinks is None else data + sinks[0].cpu().numpy().tobytes()

    def decode(
        self, data: bytes, kv_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype, *,
        starts_sequence: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (before RoPE) and V of one block."""
        expected = self.num_bytes(kv_heads, num_tokens, head_dim, starts_sequence=starts_sequence)
        if len(data) != expected:
            raise KvCodecError(f"{self.name} buffer holds {len(data)} bytes, the shape needs exactly {expected}")
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        row_bytes = self.num_bytes(kv_heads, num_tokens, head_dim)
        sinks = buffer[row_bytes:].view(1, -1) if starts_sequence else None
        blocks = self.from_rows(buffer[:row_bytes].view(1, -1), sinks, kv_heads, num_tokens, head_dim)
        k, v = self.decode_blocks(blocks, kv_heads, num_tokens, head_dim)
        return k[0].to(dtype), v[0].to(dtype)

    def num_bytes(self, kv_heads: int, num_tokens: int, head_dim: int, *, starts_sequence: bool = False) -> int:
        self._check_shape(kv_heads, num_tokens, head_dim)
        row = sum(size for _, size in self.section_sizes(kv_heads, num_tokens, head_dim))
        return row + (2 * 2 * kv_heads * head_dim if starts_sequence else 0)  # the sink: K and V of one token, fp16

    def outliers_per_head(self, num_tokens: int, head_dim: int) -> int:
        """Sparse value outliers kept per KV head in a block."""
        return self.tables.outliers_per_head(num_tokens, head_dim)

    def _check_shape(self, kv_heads: int, num_tokens: int, head_dim: int) -> None:
        check_dims(kv_heads, num_tokens, head_dim)
        if (kv_heads, head_dim) != tuple(self.key_center.shape):
            raise ValueError(
                f"{self.name} is calibrated for {self.key_center.shape[0]} KV heads of dim {self.key_center.shape[1]},"
                f" got {kv_heads} x {head_dim}"
            )
        if num_tokens * head_dim > _MAX_HEAD_ELEMENTS:
            raise ValueError(f"a block of {num_tokens} tokens x head dim {head_dim} exceeds {_MAX_HEAD_ELEMENTS}")

    # --- rows and batched tensors: `kernels.kvquant_format` under this codec's tables ----------------------------

    def section_sizes(self, kv_heads: int, num_tokens: int, head_dim: int) -> list[tuple[str, int]]:
        """(section, bytes) of a block row in layout order, the sink excluded (it follows the row when present)."""
        return self.tables.section_sizes(kv_heads, num_tokens, head_dim)

    def to_rows(self, blocks: PackedBlocks) -> tuple[torch.Tensor, torch.Tensor | None]:
        """uint8 [B, num_bytes()] rows and, for sequence-starting blocks, uint8 [B, sink bytes] (K then V, fp16)."""
        return to_rows(blocks)

    def from_rows(
        self, rows: torch.Tensor, sinks: torch.Tensor | None, kv_heads: int, num_tokens: int, head_dim: int
    ) -> PackedBlocks:
        """The inverse of `to_rows` (views into `rows` where the layout allows)."""
        return from_rows(self.tables, rows, sinks, kv_heads, num_tokens, head_dim)

    def encode_blocks(self, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool = False) -> PackedBlocks:
        """k (before RoPE), v: [B, H, T, D] -> the B blocks' sections; `starts_sequence` applies to every block."""
        return encode_blocks(self.tables, k, v, starts_sequence=starts_sequence)

    def decode_blocks(
        self, blocks: PackedBlocks, kv_heads: int, num_tokens: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (before RoPE) and V, fp32 [B, H, T, D], from `encode_blocks`' sections."""
        return decode_blocks(self.tables, blocks, kv_heads, num_tokens, head_dim)
