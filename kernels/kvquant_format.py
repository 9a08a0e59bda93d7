"""The kvquant row format: one layer of one KV block as a uint8 row, its sections, and the plain-torch arithmetic
that encodes and decodes rows in batches. The codec (`shared.kvcompress.kvquant`, whose docstring gives the method and
the byte layout) and the kernels' references (`kernels.kvquant_pack`, `kernels.kvquant_attention`) both compute here,
so the Triton kernels and the codec cannot disagree on a byte.

Owns `KvQuantTables` (one layer's calibrated codebooks and key grids), `PackedBlocks` (the sections as tensors),
`section_sizes`, `to_rows`/`from_rows` and `encode_blocks`/`decode_blocks`.

Layout of one block (H KV heads, T tokens, D head dim, b bits, n = ceil(f * T * D) value outliers per head),
little-endian:
  K codes, V codes        b-bit codes of [H, T, D] row-major, packed by `bitpack` (each packed_num_bytes(H*T*D, b))
  K low, K high           uint8 [H, D] each: the block's grid points per key channel (`key_grid`)
  V centre, V half-range  fp16 [T] each
  V outlier index, corr.  uint16 [H, n] (t * D + d, ascending per head), fp16 [H, n]
  sink (first block only) fp16 K [H, D] then V [H, D]: token 0 before RoPE, replacing its dense decoding
Codebooks and key grids are per layer (`KvQuantTables`, from the calibration file: a few KB per model), not in blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kernels.bitpack import pack_codes, packed_num_bytes, unpack_codes
from kernels.fp16_rounding import fp16_round_up

KEY_GRID_POINTS = 256  # per key channel; a block's range is two of them (uint8 each)
KEY_GRID_SPAN = 2.0  # the grid covers the calibrated centre +- this many calibrated half-ranges


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


@dataclass
class KvQuantTables:
    """One layer's kvquant calibration: b-bit codebooks and each key channel's grid.

    key_center, key_scale: fp32 [H, D], the calibrated key channel centres and half-ranges (they place each
    channel's grid, `key_grid`); key_codebook, value_codebook: fp32 [2**bits], ascending, in normalised units (a
    block's range is [-1, 1]); outlier_fraction: the share of each head's values kept as sparse fp16 corrections.
    """

    bits: int
    outlier_fraction: float
    key_center: torch.Tensor
    key_scale: torch.Tensor
    key_codebook: torch.Tensor
    value_codebook: torch.Tensor
    key_grid_base: torch.Tensor = field(init=False)
    key_grid_step: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.key_grid_base, self.key_grid_step = key_grid(self.key_center, self.key_scale)

    def outliers_per_head(self, num_tokens: int, head_dim: int) -> int:
        """Sparse value outliers kept per KV head in a block of `num_tokens` tokens."""
        return outliers_per_head(self.outlier_fraction, num_tokens, head_dim)

    def section_sizes(self, kv_heads: int, num_tokens: int, head_dim: int) -> list[tuple[str, int]]:
        """(section, bytes) of a block row in layout order, the sink excluded (it follows the row when present)."""
        return section_sizes(self.bits, kv_heads, num_tokens, head_dim, self.outliers_per_head(num_tokens, head_dim))


def encode_blocks(
    tables: KvQuantTables, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool = False
) -> PackedBlocks:
    """k (before RoPE), v: [B, H, T, D] -> the B blocks' sections; `starts_sequence` applies to every block."""
    n = tables.outliers_per_head(k.shape[2], k.shape[3])
    k32, v32 = k.float(), v.float()
    device = k.device
    key_codebook, value_codebook = tables.key_codebook.to(device), tables.value_codebook.to(device)
    norm = normalize_blocks(k32, v32, tables.key_center, tables.key_scale, n, starts_sequence)
    k_codes = nearest_code(norm.k_norm, key_codebook)
    v_codes = nearest_code(norm.v_norm, value_codebook)
    v_center, v_scale = norm.v_center, norm.v_scale
    v_dense = value_codebook[v_codes.long()] * v_scale.float()[:, None, :, None] + v_center.float()[:, None, :, None]
    v_index, v_corr = _outliers(norm.v_rank, v32 - v_dense, n)
    packed = PackedBlocks(
        k_codes=pack_rows(k_codes, tables.bits), v_codes=pack_rows(v_codes, tables.bits), k_low=norm.k_low,
        k_high=norm.k_high, v_center=v_center, v_scale=v_scale, v_outlier_index=v_index, v_outlier_value=v_corr,
    )
    if starts_sequence:
        packed.k_sink, packed.v_sink = k[:, :, 0].to(torch.float16), v[:, :, 0].to(torch.float16)
    return packed


def decode_blocks(
    tables: KvQuantTables, blocks: PackedBlocks, kv_heads: int, num_tokens: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K (before RoPE) and V, fp32 [B, H, T, D], from `encode_blocks`' sections."""
    batch = blocks.k_codes.shape[0]
    shape = (batch, kv_heads, num_tokens, head_dim)
    count = kv_heads * num_tokens * head_dim
    device = blocks.k_codes.device
    k_codes = unpack_rows(blocks.k_codes, count, tables.bits).reshape(shape).long()
    v_codes = unpack_rows(blocks.v_codes, count, tables.bits).reshape(shape).long()
    center, half = block_key_range(
        tables.key_grid_base.to(device), tables.key_grid_step.to(device), blocks.k_low, blocks.k_high
    )
    k = tables.key_codebook.to(device)[k_codes] * half[:, :, None, :] + center[:, :, None, :]
    v_center = blocks.v_center.float()[:, None, :, None]
    v = tables.value_codebook.to(device)[v_codes] * blocks.v_scale.float()[:, None, :, None] + v_center
    v.view(batch, kv_heads, -1).scatter_add_(2, blocks.v_outlier_index, blocks.v_outlier_value.float())
    if blocks.k_sink is not None and blocks.v_sink is not None:
        k[:, :, 0], v[:, :, 0] = blocks.k_sink.float(), blocks.v_sink.float()
    return k, v


def to_rows(blocks: PackedBlocks) -> tuple[torch.Tensor, torch.Tensor | None]:
    """uint8 [B, row bytes] rows and, for sequence-starting blocks, uint8 [B, sink bytes] (K then V, fp16)."""
    parts = [blocks.k_codes, blocks.v_codes, _as_bytes(blocks.k_low), _as_bytes(blocks.k_high),
             _as_bytes(blocks.v_center), _as_bytes(blocks.v_scale),
             _as_bytes(blocks.v_outlier_index.to(torch.int32).to(torch.int16)), _as_bytes(blocks.v_outlier_value)]
    rows = torch.cat(parts, dim=1)
    if blocks.k_sink is None or blocks.v_sink is None:
        return rows, None
    return rows, torch.cat([_as_bytes(blocks.k_sink), _as_bytes(blocks.v_sink)], dim=1)


def from_rows(
    tables: KvQuantTables, rows: torch.Tensor, sinks: torch.Tensor | None, kv_heads: int, num_tokens: int,
    head_dim: int,
) -> PackedBlocks:
    """The inverse of `to_rows` (views into `rows` where the layout allows)."""
    sizes = tables.section_sizes(kv_heads, num_tokens, head_dim)
    batch, n = rows.shape[0], tables.outliers_per_head(num_tokens, head_dim)
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


def outliers_per_head(outlier_fraction: float, num_tokens: int, head_dim: int) -> int:
    """Sparse value outliers kept per KV head in a block of `num_tokens` tokens at that share of its values."""
    return math.ceil(outlier_fraction * num_tokens * head_dim - 1e-9)


def section_sizes(bits: int, kv_heads: int, num_tokens: int, head_dim: int, num_outliers: int) -> list[tuple[str, int]]:
    """(section, bytes) of one block row in layout order (the module docstring), named as `PackedBlocks`' fields;
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
