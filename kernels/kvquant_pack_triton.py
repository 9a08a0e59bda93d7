"""Fused Triton quantize-and-pack of full KV blocks into kvquant pool rows, and its checking launcher.

Bit-identical to `kernels.kvquant_pack.kvquant_pack_ref` (the codec's encode) given the same value outliers: the same
fp32 operations in the same order (true division, no fused multiply-add: the kernels launch with
enable_fp_fusion=False), on the key grids `KvQuantLayerParams` computed with the codec's own `key_grid`. Two launches:
per (block, token tile) the values' per-token range over every head's inliers (it needs all heads); then per (block,
KV head) its key channels' block range (a first pass over the head's tokens, token 0 left out when the block starts a
sequence: the sink is kept whole and in no range), then the K and V codes, bit-packed, and the value outliers'
corrections (which need the value ranges). Keys have no outliers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kernels.backend import jit_into, on_grid
from kernels.kvquant_format import KEY_GRID_POINTS
from kernels.kvquant_layout import KvQuantLayerParams, check_kernel_layout

triton: Any = None  # bound by _load_triton, as in kernels.paged_attention_triton
tl: Any = None


# ---- Triton kernels, jitted by _load_triton ----------------------------------------------------------------


def _fp16_round_up(x):
    # The smallest fp16 >= x, for x >= 0 (`kernels.fp16_rounding.fp16_round_up`)
    nearest = x.to(tl.float16)
    above = (nearest.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    return tl.where(nearest.to(tl.float32) < x, above, nearest)


def _nearest(x, midpoints_ptr, BITS: tl.constexpr):
    # Codebook index nearest to x: the number of midpoints strictly below it (torch.bucketize, ties down)
    code = tl.zeros(x.shape, tl.int32)
    for j in tl.static_range((1 << BITS) - 1):
        code += (x > tl.load(midpoints_ptr + j)).to(tl.int32)
    return code


def _value_range_kernel(
    rows16_ptr, v_ptr, outlier_ptr, kv_heads, row_bytes, v_center_offset, v_scale_offset,
    T: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
):
    block, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    toks, dims = tile * TILE + tl.arange(0, TILE), tl.arange(0, D)
    low = tl.full([TILE], float("inf"), tl.float32)
    high = tl.full([TILE], float("-inf"), tl.float32)
    for head in range(kv_heads):
        at = ((block * kv_heads + head) * T + toks[:, None]) * D + dims[None, :]
        x = tl.load(v_ptr + at).to(tl.float32)
        is_outlier = tl.load(outlier_ptr + at) != 0
        low = tl.minimum(low, tl.min(tl.where(is_outlier, float("inf"), x), 1))
        high = tl.maximum(high, tl.max(tl.where(is_outlier, float("-inf"), x), 1))
    center = ((high + low) / 2).to(tl.float16)
    center32 = center.to(tl.float32)
    scale = _fp16_round_up(tl.maximum(high - center32, center32 - low))
    scale = tl.where(scale > 0, scale, 1.0).to(tl.float16)  # a constant token gets 1
    row16 = rows16_ptr + block * (row_bytes // 2)
    tl.store(row16 + v_center_offset // 2 + toks, center)
    tl.store(row16 + v_scale_offset // 2 + toks, scale)


def _key_range(row, k_ptr, grid_base_ptr, grid_step_ptr, src_base, head, first_token, k_low_offset, k_high_offset,
               TOP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr):
    # One head's key channels over tokens first_token..T-1: the grid points (0..TOP) at or below their minimum and at
    # or above their maximum, stored as K low and K high (`kernels.kvquant_format._key_range_points`), and the
    # block centre and half-range [D] fp32 they give (`block_key_range`)
    dims = tl.arange(0, D)
    low = tl.full([D], float("inf"), tl.float32)
    high = tl.full([D], float("-inf"), tl.float32)
    for start in range(0, T, TILE):
        toks = start + tl.arange(0, TILE)
        x = tl.load(k_ptr + src_base + toks[:, None] * D + dims[None, :]).to(tl.float32)
        is_kept = (toks >= first_token)[:, None]
        low = tl.minimum(low, tl.min(tl.where(is_kept, x, float("inf")), 0))
        high = tl.maximum(high, tl.max(tl.where(is_kept, x, float("-inf")), 0))
    base, step = tl.load(grid_base_ptr + head * D + dims), tl.load(grid_step_ptr + head * D + dims)
    low_point = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(low - base, step)), 0.0), TOP - 1.0)
    high_point = tl.minimum(tl.maximum(tl.ceil(tl.math.div_rn(high - base, step)), 0.0), TOP * 1.0)
    high_point = tl.maximum(high_point, low_point + 1.0)
    tl.store(row + k_low_offset + head * D + dims, low_point.to(tl.uint8))
    tl.store(row + k_high_offset + head * D + dims, high_point.to(tl.uint8))
    low_value, high_value = base + low_point * step, base + high_point * step
    return (high_value + low_value) * 0.5, (high_value - low_value) * 0.5


def _pack_words(code, BITS: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr):
    # Codes int32 [TILE, D] -> their lcm(BITS, 8)-bit groups int32 [TILE, D / GROUP]: channel w * GROUP + i at bit
    # BITS * i of group w (disjoint bits, so the sum is their OR)
    shift = (tl.arange(0, D) % GROUP) * BITS
    return tl.sum(tl.reshape(code << shift[None, :], [TILE, D // GROUP, GROUP]), 2)


def _value_corrections(row16, v_ptr, index_ptr, midpoints_ptr, codebook_ptr, src_base, num_outliers,
                       v_center_offset, v_scale_offset, BITS: tl.constexpr, D: tl.constexpr, N_PAD: tl.constexpr):
    # One head's value outliers: flat index and fp16 correction v - (codebook * token half-range + token centre)
    i = tl.arange(0, N_PAD)
    is_real = i < num_outliers
    index = tl.load(index_ptr + i, mask=is_real, other=0).to(tl.int32)
    tok = index // D
    x = tl.load(v_ptr + src_base + index, mask=is_real, other=0.0).to(tl.float32)
    v_center = tl.load(row16 + v_center_offset // 2 + tok).to(tl.float32)
    v_scale = tl.load(row16 + v_scale_offset // 2 + tok).to(tl.float32)
    code = _nearest(tl.math.div_rn(x - v_center, v_scale), midpoints_ptr, BITS)
    dense = tl.load(codebook_ptr + code) * v_scale + v_center
    return index, (x - dense).to(tl.float16)


def _store_outliers(row16, index_offset, corr_offset, head, num_outliers, index, corr, N_PAD: tl.constexpr):
    i = tl.arange(0, N_PAD)
    at = head * num_outliers + i
    is_real = i < num_outliers
    tl.store(row16 + index_offset // 2 + at, index.to(tl.int16).to(tl.float16, bitcast=True), mask=is_real)
    tl.store(row16 + corr_offset // 2 + at, corr, mask=is_real)


def _pack_codes_kernel(
    rows_ptr, rows16_ptr, k_ptr, v_ptr, v_index_ptr,
    grid_base_ptr, grid_step_ptr, key_midpoints_ptr, value_midpoints_ptr, value_codebook_ptr,
    kv_heads, num_outliers, first_token, row_bytes, v_codes_offset, k_low_offset, k_high_offset, v_center_offset,
    v_scale_offset, v_index_offset, v_corr_offset,
    BITS: tl.constexpr, GROUP: tl.constexpr, WORD_BYTES: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    TILE: tl.constexpr, N_PAD: tl.constexpr, HAS_OUTLIERS: tl.constexpr, GRID_TOP: tl.constexpr,
):
    block, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row, row16 = rows_ptr + block * row_bytes, rows16_ptr + block * (row_bytes // 2)
    src_base = (block * kv_heads + head) * T * D  # this (block, head)'s [T, D] in k and v
    k_center, k_half = _key_range(row, k_ptr, grid_base_ptr, grid_step_ptr, src_base, head, first_token,
                                  k_low_offset, k_high_offset, GRID_TOP, T, D, TILE)
    dims, words = tl.arange(0, D), tl.arange(0, D // GROUP)
    for start in range(0, T, TILE):
        toks = start + tl.arange(0, TILE)
        at = src_base + toks[:, None] * D + dims[None, :]
        k_norm = tl.math.div_rn(tl.load(k_ptr + at).to(tl.float32) - k_center[None, :], k_half[None, :])
        k_word = _pack_words(_nearest(k_norm, key_midpoints_ptr, BITS), BITS, GROUP, TILE, D)
        v_center = tl.load(row16 + v_center_offset // 2 + toks).to(tl.float32)[:, None]
        v_scale = tl.load(row16 + v_scale_offset // 2 + toks).to(tl.float32)[:, None]
        v_norm = tl.math.div_rn(tl.load(v_ptr + at).to(tl.float32) - v_center, v_scale)
        v_word = _pack_words(_nearest(v_norm, value_midpoints_ptr, BITS), BITS, GROUP, TILE, D)
        dst = ((head * T + toks[:, None]) * (D // GROUP) + words[None, :]) * WORD_BYTES
        for j in tl.static_range(WORD_BYTES):  # little-endian
            tl.store(row + dst + j, ((k_word >> (8 * j)) & 0xFF).to(tl.uint8))
            tl.store(row + v_codes_offset + dst + j, ((v_word >> (8 * j)) & 0xFF).to(tl.uint8))
    if HAS_OUTLIERS:
        index, corr = _value_corrections(row16, v_ptr, v_index_ptr + (block * kv_heads + head) * num_outliers,
                                         value_midpoints_ptr, value_codebook_ptr, src_base, num_outliers,
                                         v_center_offset, v_scale_offset, BITS, D, N_PAD)
        _store_outliers(row16, v_index_offset, v_corr_offset, head, num_outliers, index, corr, N_PAD)


_KERNELS = (_fp16_round_up, _nearest, _value_range_kernel, _key_range, _pack_words, _value_corrections,
            _store_outliers, _pack_codes_kernel)


def _load_triton() -> None:
    """Import triton and jit the kernels above; RuntimeError if triton is not installed."""
    global triton
    triton = jit_into(globals(), _KERNELS)


# ---- Launcher ----------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _require(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise ValueError(message)


def kvquant_pack_triton(
    k: torch.Tensor, v: torch.Tensor, v_outlier_index: torch.Tensor, params: KvQuantLayerParams, *,
    starts_sequence: bool = False,
) -> torch.Tensor:
    """Full blocks' k (before RoPE), v [B, H, T, D] -> pool rows uint8 [B, bytes_per_block].

    Args:
        v_outlier_index: int [B, H, n], each head's value outliers as t * D + d, ascending and distinct
            (`kernels.kvquant_pack.select_outliers`, given the same `starts_sequence`).
        starts_sequence: every block starts a sequence: token 0 (the sink) stays out of the key ranges.
    Not checked (a device sync): indices in range; finite values (the codec would refuse them).
    Raises:
        ValueError: on mismatched shapes, dtypes or devices, or a layout the kernels do not handle.
    """
    if triton is None:
        _load_triton()
    layout = params.layout
    check_kernel_layout(layout)
    shape = (k.shape[0], layout.kv_heads, layout.block_size, layout.head_dim)
    _require(k.shape == v.shape == shape and k.dtype in _FLOAT_DTYPES and v.dtype in _FLOAT_DTYPES,
             f"k and v must be float [B, {layout.kv_heads}, {layout.block_size}, {layout.head_dim}], got "
             f"{tuple(k.shape)} and {tuple(v.shape)}")
    index_shape = (k.shape[0], layout.kv_heads, layout.num_outliers)
    _require(v_outlier_index.shape == index_shape and v_outlier_index.dtype in _INDEX_DTYPES,
             f"value outlier indices must be int {list(index_shape)}, got {v_outlier_index.dtype}"
             f" {tuple(v_outlier_index.shape)}")
    devices = {t.device for t in (k, v, v_outlier_index, params.key_grid_base)}
    _require(len(devices) == 1, f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    rows = torch.empty(k.shape[0], layout.bytes_per_block, dtype=torch.uint8, device=k.device)
    if k.shape[0] == 0:
        return rows
    k, v, v_index = k.contiguous(), v.contiguous(), v_outlier_index.contiguous()
    is_outlier = torch.zeros(k.shape[0], layout.kv_heads, layout.block_size * layout.head_dim, dtype=torch.uint8,
                             device=k.device).scatter_(2, v_index.long(), 1)  # the values' range skips these
    rows16 = rows.view(torch.float16)
    tile = min(layout.block_size, 32)
    common = {"T": layout.block_size, "D": layout.head_dim, "TILE": tile, "enable_fp_fusion": False}
    on_grid(_value_range_kernel, (k.shape[0], layout.block_size // tile))(
        rows16, v, is_outlier, layout.kv_heads, layout.bytes_per_block, layout.v_center_offset,
        layout.v_scale_offset, **common,
    )
    bits = layout.bits
    on_grid(_pack_codes_kernel, (k.shape[0], layout.kv_heads))(
        rows, rows16, k, v, v_index, params.key_grid_base, params.key_grid_step, params.key_midpoints,
        params.value_midpoints, params.value_codebook,
        layout.kv_heads, layout.num_outliers, int(starts_sequence), layout.bytes_per_block, layout.v_codes_offset,
        layout.k_low_offset, layout.k_high_offset, layout.v_center_offset, layout.v_scale_offset,
        layout.v_index_offset, layout.v_corr_offset,
        BITS=bits, GROUP=math.lcm(bits, 8) // bits, WORD_BYTES=math.lcm(bits, 8) // 8,
        N_PAD=max(16, triton.next_power_of_2(layout.num_outliers)), HAS_OUTLIERS=layout.num_outliers > 0,
        GRID_TOP=KEY_GRID_POINTS - 1, **common,
    )
    return rows
