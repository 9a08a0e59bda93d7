"""KVQuant (Hooper et al. 2024, "KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache
Quantization"): non-uniform, calibrated, dense-and-sparse 2/3/4-bit codes for one layer of one KV block.

Owns the kvquant byte layout and its tensor-level encode/decode (batched over blocks, for the engine and the kernels'
oracle); the calibration it reads is `calibration`, the bit layout `bitpack`.

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

Layout of one block (H KV heads, T tokens, D head dim, b bits, n = ceil(f * T * D) value outliers per head),
little-endian:
  K codes, V codes        b-bit codes of [H, T, D] row-major, packed by `bitpack` (each packed_num_bytes(H*T*D, b))
  K low, K high           uint8 [H, D] each: the block's grid points per key channel (`key_grid`)
  V centre, V half-range  fp16 [T] each
  V outlier index, corr.  uint16 [H, n] (t * D + d, ascending per head), fp16 [H, n]
  sink (first block only) fp16 K [H, D] then V [H, D]: token 0 before RoPE, replacing its dense decoding
Codebooks and key grids are per layer, in the calibration file (a few KB per model), not in blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.kvcompress.bitpack import pack_codes, packed_num_bytes, unpack_codes
from shared.kvcompress.codec import KvCodec, KvCodecError, check_dims, check_kv
from shared.kvcompress.names import KVQUANT_BITS
from shared.kvcompress.quantize import fp16_round_up

KEY_GRID_POINTS = 256  # per key channel; a block's range is two of them (uint8 each)
KEY_GRID_SPAN = 2.0  # the grid covers the calibrated centre +- this many calibrated half-ranges
_MAX_HEAD_ELEMENTS = 1 << 16  # outlier indices are uint16 within one head's [T, D]


@dataclass
class PackedBlocks:
    """kvquant blocks as tensors, a leading block dimension B on each: what the bytes hold, section by section."""

    k_codes: torch.Tensor  # uint8 [B, packed bytes]
    v_codes: torch.Tensor  # uint8 [B, packed bytes]
    k_low: torch.Tensor  # uint8 [B, H, D]: grid point at or below each key channel's block minimum
    k_high: torch.Tensor  # uint8 [B, H, D]: grid point at or above its block maximum
    v_center: torch.Tensor  # fp16 [B, T]
    v_scale: torch.Tensor  # fp16 [B, T]
    v_outlier_index: torch.Tensor  # int64 [B, H, n]
    v_outlier_value: torch.Tensor  # fp16 [B, H, n]
    k_sink: torch.Tensor | None = None  # fp16 [B, H, D], sequence-starting blocks only
    v_sink: torch.Tensor | None = None


class KvQuantCodec(KvCodec):
    """One layer's kvquant-b codec.

    Args:
        bits: 2, 3 or 4.
        key_center, key_scale: fp32 [kv_heads, head_dim], the calibrated key channel centres and half-ranges (they
            place each channel's grid, `key_grid`).
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
        self.key_center, self.key_scale = key_center.float().cpu(), key_scale.float().cpu()
        self.key_codebook, self.value_codebook = key_codebook.float().cpu(), value_codebook.float().cpu()
        self.key_grid_base, self.key_grid_step = key_grid(self.key_center, self.key_scale)  # what decode reads

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
        return math.ceil(self.outlier_fraction * num_tokens * head_dim - 1e-9)

    def _check_shape(self, kv_heads: int, num_tokens: int, head_dim: int) -> None:
        check_dims(kv_heads, num_tokens, head_dim)
        if (kv_heads, head_dim) != tuple(self.key_center.shape):
            raise ValueError(
                f"{self.name} is calibrated for {self.key_center.shape[0]} KV heads of dim {self.key_center.shape[1]},"
                f" got {kv_heads} x {head_dim}"
            )
        if num_tokens * head_dim > _MAX_HEAD_ELEMENTS:
            raise ValueError(f"a block of {num_tokens} tokens x head dim {head_dim} exceeds {_MAX_HEAD_ELEMENTS}")

    # --- rows: the byte layout as uint8 tensors, one row per block (the engine's pool, the kernels' input) ---------

    def section_sizes(self, kv_heads: int, num_tokens: int, head_dim: int) -> list[tuple[str, int]]:
        """(section, bytes) of a block row in layout order, the sink excluded (it follows the row when present)."""
        return section_sizes(self.bits, kv_heads, num_tokens, head_dim, self.outliers_per_head(num_tokens, head_dim))

    def to_rows(self, blocks: PackedBlocks) -> tuple[torch.Tensor, torch.Tensor | None]:
        """uint8 [B, num_bytes()] rows and, for sequence-starting blocks, uint8 [B, sink bytes] (K then V, fp16)."""
        parts = [blocks.k_codes, blocks.v_codes, _as_bytes(blocks.k_low), _as_bytes(blocks.k_high),
                 _as_bytes(blocks.v_center), _as_bytes(blocks.v_scale),
                 _as_bytes(blocks.v_outlier_index.to(torch.int32).to(torch.int16)), _as_bytes(blocks.v_outlier_value)]
        rows = torch.cat(parts, dim=1)
        if blocks.k_sink is None or blocks.v_sink is None:
            return rows, None
        return rows, torch.cat([_as_bytes(blocks.k_sink), _as_bytes(blocks.v_sink)], dim=1)

    def from_rows(
        self, rows: torch.Tensor, sinks: torch.Tensor | None, kv_heads: int, num_tokens: int, head_dim: int
    ) -> PackedBlocks:
        """The inverse of `to_rows` (views into `rows` where the layout allows)."""
        sizes = self.section_sizes(kv_heads, num_tokens, head_dim)
        batch, n = rows.shape[0], self.outliers_per_head(num_tokens, head_dim)
        cut = dict(zip((name for name, _ in sizes), rows.split([size for _, size in sizes], dim=1), strict=True))
        fp16 = {name: cut[name].contiguous().view(torch.float16) for name in ("v_center", "v_scale", "v_outlier_value")}
        blocks = PackedBlocks(
            cut["k_codes"], cut["v_codes"], cut["k_low"].reshape(batch, kv_heads, head_dim),
            cut["k_high"].reshape(batch, kv_heads, head_dim), fp16["v_center"], fp16["v_scale"],
            (cut["v_outlier_index"].contiguous().view(torch.int16).to(torch.int64) & 0xFFFF).view(batch, kv_heads, n),
            fp16["v_outlier_value"].view(batch, kv_heads, n),
        )
        if sinks is not None:
            sink = sinks.contiguous().view(torch.float16).view(batch, 2, kv_heads, head_dim)
            blocks.k_sink, blocks.v_sink = sink[:, 0], sink[:, 1]
        return blocks

    # --- tensors, batched over blocks ------------------------------------------------------------------------------

    def encode_blocks(self, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool = False) -> PackedBlocks:
        """k (before RoPE), v: [B, H, T, D] -> the B blocks' sections; `starts_sequence` applies to every block."""
        n = self.outliers_per_head(k.shape[2], k.shape[3])
        k32, v32 = k.float(), v.float()
        device = k.device
        norm = normalize_blocks(k32, v32, self.key_center, self.key_scale, n, starts_sequence)
        k_codes = nearest_code(norm.k_norm, self.key_codebook.to(device))
        v_codes = nearest_code(norm.v_norm, self.value_codebook.to(device))
        v_center, v_scale = norm.v_center, norm.v_scale
        v_dense = self.value_codebook.to(device)[v_codes.long()] * v_scale.float()[:, None, :, None] \
            + v_center.float()[:, None, :, None]
        v_index, v_corr = _outliers(norm.v_rank, v32 - v_dense, n)
        packed = PackedBlocks(
            k_codes=pack_rows(k_codes, self.bits), v_codes=pack_rows(v_codes, self.bits), k_low=norm.k_low,
            k_high=norm.k_high, v_center=v_center, v_scale=v_scale, v_outlier_index=v_index, v_outlier_value=v_corr,
        )
        if starts_sequence:
            packed.k_sink, packed.v_sink = k[:, :, 0].to(torch.float16), v[:, :, 0].to(torch.float16)
        return packed

    def decode_blocks(
        self, blocks: PackedBlocks, kv_heads: int, num_tokens: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (before RoPE) and V, fp32 [B, H, T, D], from `encode_blocks`' sections."""
        batch = blocks.k_codes.shape[0]
        shape = (batch, kv_heads, num_tokens, head_dim)
        count = kv_heads * num_tokens * head_dim
        device = blocks.k_codes.device
        k_codes = unpack_rows(blocks.k_codes, count, self.bits).reshape(shape).long()
        v_codes = unpack_rows(blocks.v_codes, count, self.bits).reshape(shape).long()
        center, half = block_key_range(
            self.key_grid_base.to(device), self.key_grid_step.to(device), blocks.k_low, blocks.k_high
        )
        k = self.key_codebook.to(device)[k_codes] * half[:, :, None, :] + center[:, :, None, :]
        v_center = blocks.v_center.float()[:, None, :, None]
        v = self.value_codebook.to(device)[v_codes] * blocks.v_scale.float()[:, None, :, None] + v_center
        v.view(batch, kv_heads, -1).scatter_add_(2, blocks.v_outlier_index, blocks.v_outlier_value.float())
        if blocks.k_sink is not None and blocks.v_sink is not None:
            k[:, :, 0], v[:, :, 0] = blocks.k_sink.float(), blocks.v_sink.float()
        return k, v


def key_grid(key_center: torch.Tensor, key_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each key channel's grid, fp32 [H, D] each: point q (0..255) is base + q * step, spanning centre +- 2 scales."""
    base = key_center - KEY_GRID_SPAN * key_scale
    step = key_scale * (2 * KEY_GRID_SPAN / (KEY_GRID_POINTS - 1))
    return base, step


def block_key_range(
    base: torch.Tensor, step: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [B, H, D] centre and half-range of each block's key channels from their grid points (uint8 [B, H, D])."""
    low_value = base + low.float() * step
    high_value = base + high.float() * step
    return (high_value + low_value) / 2, (high_value - low_value) / 2


@dataclass
class NormalizedBlocks:
    """Blocks mapped to codebook units, before rounding: what encode rounds and calibration clusters."""

    k_norm: torch.Tensor  # fp32 [B, H, T, D]: (k - block centre) / block half-range per channel
    v_norm: torch.Tensor  # fp32 [B, H, T, D]: (v - token centre) / token half-range
    v_rank: torch.Tensor  # fp32 [B, H, T, D]: how far out each value is (the top n per head are outliers)
    k_low: torch.Tensor  # uint8 [B, H, D]
    k_high: torch.Tensor  # uint8 [B, H, D]
    v_center: torch.Tensor  # fp16 [B, T]
    v_scale: torch.Tensor  # fp16 [B, T]


def normalize_blocks(
    k: torch.Tensor, v: torch.Tensor, key_center: torch.Tensor, key_scale: torch.Tensor, n: int,
    starts_sequence: bool,
) -> NormalizedBlocks:
    """Normalise fp32 pre-RoPE keys per (block, channel) and values per token (range over every head's inliers).

    A key channel's block range is the pair of grid points just outside its minimum and maximum, clamped to the
    grid (keys beyond it round to the nearest end). A value's rank is its distance from its token's mean in token
    standard deviations. A sequence's first token (the sink, stored whole) gets rank -1, never an outlier, and sits
    in no range.
    Raises:
        ValueError: keys or values holding NaN, inf, or magnitudes beyond the fp16 range.
    """
    if not bool(torch.isfinite(k).all()):
        raise ValueError("cannot quantize: the keys hold NaN or inf")
    sink = torch.zeros(k.shape[2], dtype=torch.bool, device=k.device)
    sink[0] = starts_sequence
    base, step = key_grid(key_center.to(k.device), key_scale.to(k.device))
    k_low, k_high = _key_range_points(k, sink, base, step)
    center, half = block_key_range(base, step, k_low, k_high)
    k_norm = (k - center[:, :, None, :]) / half[:, :, None, :]
    v_rank = value_rank(v, starts_sequence)
    v_center, v_scale = _token_range(v, top_mask(v_rank, n))
    v_norm = (v - v_center.float()[:, None, :, None]) / v_scale.float()[:, None, :, None]
    return NormalizedBlocks(k_norm, v_norm, v_rank, k_low, k_high, v_center, v_scale)


def value_rank(v: torch.Tensor, starts_sequence: bool) -> torch.Tensor:
    """fp32 [B, H, T, D]: how far out each value is, its distance from its token's mean (over every head) in token
    standard deviations; a sequence's first token (the sink) gets -1, never an outlier."""
    v = v.float()
    mean = v.mean(dim=(1, 3), keepdim=True)
    std = v.std(dim=(1, 3), keepdim=True, correction=0).clamp_min(1e-6)
    rank = (v - mean).abs() / std
    if starts_sequence:
        rank[:, :, 0] = -1.0
    return rank


def _key_range_points(
    k: torch.Tensor, sink: torch.Tensor, base: torch.Tensor, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (block, head, channel) over the tokens not masked by `sink` (bool [T]): uint8 grid points at or below
    the minimum and at or above the maximum, at least one point apart (a block with no such token gets 254, 255)."""
    low = k.masked_fill(sink[None, None, :, None], float("inf")).amin(dim=2)
    high = k.masked_fill(sink[None, None, :, None], float("-inf")).amax(dim=2)
    top = KEY_GRID_POINTS - 1
    low_point = torch.floor((low - base) / step).clamp(0, top - 1)
    high_point = torch.maximum(torch.ceil((high - base) / step).clamp(0, top), low_point + 1)
    return low_point.to(torch.uint8), high_point.to(torch.uint8)


def section_sizes(bits: int, kv_heads: int, num_tokens: int, head_dim: int, num_outliers: int) -> list[tuple[str, int]]:
    """(section, bytes) of one block row in layout order (see the module docstring), named as `PackedBlocks`' fields;
    `num_outliers` value outliers per head. Every section is a whole number of its elements, and every 2-byte
    section starts even."""
    packed = packed_num_bytes(kv_heads * num_tokens * head_dim, bits)
    outliers = kv_heads * num_outliers * 2
    return [("k_codes", packed), ("v_codes", packed), ("k_low", kv_heads * head_dim), ("k_high", kv_heads * head_dim),
            ("v_center", 2 * num_tokens), ("v_scale", 2 * num_tokens), ("v_outlier_index", outliers),
            ("v_outlier_value", outliers)]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """[B, ...] of a 2-byte dtype -> uint8 [B, bytes] in native (little-endian on every supported host) order."""
    return tensor.contiguous().view(tensor.shape[0], -1).view(torch.uint8)


def nearest_code(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """uint8 index of the codebook entry nearest to each element (ties to the lower entry)."""
    midpoints = (codebook[1:] + codebook[:-1]) / 2
    return torch.bucketize(x.contiguous(), midpoints).to(torch.uint8)


def top_mask(rank: torch.Tensor, n: int) -> torch.Tensor:
    """bool [B, H, T, D]: per (block, head), the n elements of highest rank (the outliers)."""
    mask = torch.zeros(rank.shape, dtype=torch.bool, device=rank.device)
    if n:
        flat = rank.flatten(2)
        mask.view(flat.shape).scatter_(2, flat.topk(n, dim=2).indices, True)
    return mask


def _token_range(v: torch.Tensor, outlier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (block, token), over every head's non-outlier values: fp16 centre and half-range ([B, T] each).

    The half-range is rounded up to fp16 so the stored range still covers every inlier; a constant token gets 1.
    """
    low = v.masked_fill(outlier, float("inf")).amin(dim=(1, 3))
    high = v.masked_fill(outlier, float("-inf")).amax(dim=(1, 3))
    center = ((high + low) / 2).to(torch.float16)
    half = torch.maximum(high - center.float(), center.float() - low)
    scale = fp16_round_up(half)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if not bool(torch.isfinite(center).all() & torch.isfinite(scale).all()):
        raise ValueError("cannot quantize: the values hold NaN, inf, or magnitudes beyond the fp16 range")
    return center, scale


def _outliers(rank: torch.Tensor, residual: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (block, head), the n highest-ranked elements: ascending flat index (int64) and fp16 correction."""
    batch, heads = rank.shape[:2]
    if not n:
        empty = torch.empty(batch, heads, 0, dtype=torch.int64, device=rank.device)
        return empty, empty.to(torch.float16)
    index = rank.flatten(2).topk(n, dim=2).indices.sort(dim=2).values
    return index, residual.flatten(2).gather(2, index).to(torch.float16)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [B, ...] -> [B, packed_num_bytes(codes per block, bits)]: each block packed on its own."""
    batch, count = codes.shape[0], codes[0].numel()
    group = math.lcm(bits, 8) // bits
    padded = codes.new_zeros(batch, -(-count // group) * group)
    padded[:, :count] = codes.reshape(batch, count)
    return pack_codes(padded, bits).view(batch, -1)


def unpack_rows(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The inverse of `pack_rows`: uint8 [B, count]."""
    batch = packed.shape[0]
    group = math.lcm(bits, 8) // bits
    padded = -(-count // group) * group
    return unpack_codes(packed.reshape(-1), batch * padded, bits).view(batch, padded)[:, :count]
