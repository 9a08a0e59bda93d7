"""Triton device functions reading one KV head's share of a kvquant pool row: code groups and their codebook entries,
the block's key channel ranges, the sparse value outliers, cache prefetches. Called by
`kernels.kvquant_attention_triton`, which jits them through `load_triton`; the row layout is `kernels.kvquant_layout`.
"""

from __future__ import annotations

from typing import Any

from kernels.backend import jit_into

triton: Any = None  # bound by load_triton, as in kernels.paged_attention_triton
tl: Any = None


def load_words(byte_ptr, word_index, BITS: tl.constexpr):
    # word_index [R, W] -> those lcm(BITS, 8)-bit little-endian groups of codes, int32 [R, W]
    if BITS == 3:
        base = byte_ptr + word_index * 3
        word = tl.load(base).to(tl.int32) | (tl.load(base + 1).to(tl.int32) << 8)
        return word | (tl.load(base + 2).to(tl.int32) << 16)
    else:
        return tl.load(byte_ptr + word_index).to(tl.int32)


def _pair(word, i: tl.constexpr, j: tl.constexpr, table_ptr, BITS: tl.constexpr, CODE_STRIDE: tl.constexpr,
          COLUMN_STEP: tl.constexpr):
    # [R, W, 2]: the table entries of codes i and j of each group (at table_ptr + column * COLUMN_STEP +
    # code * CODE_STRIDE), looked up in the groups' own layout
    mask: tl.constexpr = (1 << BITS) - 1
    first = tl.load(table_ptr + i * COLUMN_STEP + ((word >> (BITS * i)) & mask) * CODE_STRIDE)
    return tl.join(first, tl.load(table_ptr + j * COLUMN_STEP + ((word >> (BITS * j)) & mask) * CODE_STRIDE))


def decode_groups(word, table_ptr, BITS: tl.constexpr, GROUP: tl.constexpr, CODE_STRIDE: tl.constexpr,
                  COLUMN_STEP: tl.constexpr):
    # Groups [R, W] -> table entries [R, W * GROUP], code i of a group at column i: joined as
    # join(interleave(even codes), interleave(odd codes)), which the reshape lays out in order
    args = (table_ptr, BITS, CODE_STRIDE, COLUMN_STEP)
    if GROUP == 2:
        values = _pair(word, 0, 1, *args)
    elif GROUP == 4:
        values = tl.join(_pair(word, 0, 2, *args), _pair(word, 1, 3, *args))
    else:
        even = tl.join(_pair(word, 0, 4, *args), _pair(word, 2, 6, *args))
        values = tl.join(even, tl.join(_pair(word, 1, 5, *args), _pair(word, 3, 7, *args)))
    return tl.reshape(values, [word.shape[0], word.shape[1] * GROUP])


def key_range(row_ptr, k_low_offset, k_high_offset, base, step, kv_head, HALF: tl.constexpr, D: tl.constexpr):
    # One half of a head's key channels in the block: centre and half-range [D / 2], fp32, from the row's K low and
    # K high grid points and the channels' grid base, step [D / 2] (`shared.kvcompress.kvquant.block_key_range`)
    at = kv_head * D + HALF * (D // 2) + tl.arange(0, D // 2)
    low = base + tl.load(row_ptr + k_low_offset + at).to(tl.float32) * step
    high = base + tl.load(row_ptr + k_high_offset + at).to(tl.float32) * step
    return (high + low) * 0.5, (high - low) * 0.5


def dense_keys(row_ptr, key_cb_ptr, k_low_offset, k_high_offset, base, step, kv_head, HALF: tl.constexpr,
               BITS: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr):
    # One half (HALF = 0 or 1) of a head's pre-RoPE keys [T, D / 2], fp32: codebook[code] * half-range + centre in
    # each channel, by the block's own range (`key_range`); base, step [D / 2]: that half's grid
    words: tl.constexpr = D // 2 // GROUP
    toks, cols = tl.arange(0, T), tl.arange(0, words)
    word_index = (kv_head * T + toks[:, None]) * (D // GROUP) + HALF * words + cols[None, :]
    units = decode_groups(load_words(row_ptr, word_index, BITS), key_cb_ptr, BITS, GROUP, 1, 0)
    center, half = key_range(row_ptr, k_low_offset, k_high_offset, base, step, kv_head, HALF, D)
    return units * half[None, :] + center[None, :]


def load_outliers(row16_ptr, index_offset, corr_offset, kv_head, num_outliers, start, D: tl.constexpr,
                  CHUNK: tl.constexpr):
    # Sparse corrections start..start+CHUNK-1 of a head: token, channel (int32 [CHUNK]), fp32 value (0 past the end)
    i = start + tl.arange(0, CHUNK)
    is_real = i < num_outliers
    at = kv_head * num_outliers + i
    index = tl.load(row16_ptr + index_offset // 2 + at, mask=is_real, other=0.0).to(tl.int16, bitcast=True)
    index = index.to(tl.int32) & 0xFFFF  # stored as uint16
    corr = tl.load(row16_ptr + corr_offset // 2 + at, mask=is_real, other=0.0).to(tl.float32)
    return index // D, index % D, corr


def _prefetch_lines(ptr, num_bytes, LINES: tl.constexpr):
    # A cache hint for every 128-byte line of [ptr, ptr + num_bytes) (LINES covers them): PTX, so GPU only (the
    # interpreter cannot run inline assembly; the kernels skip this there)
    addr = ptr + tl.minimum(tl.arange(0, LINES) * 128, tl.maximum(num_bytes - 1, 0))
    tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                              is_pure=False, pack=1)


def prefetch_block(table_ptr, index, pool_ptr, row_bytes, kv_head, num_outliers, v_codes_offset, k_low_offset,
                   k_high_offset, v_center_offset, v_index_offset, v_corr_offset, BITS: tl.constexpr,
                   T: tl.constexpr, D: tl.constexpr, CODE_LINES: tl.constexpr, RANGE_LINES: tl.constexpr,
                   META_LINES: tl.constexpr, OUTLIER_LINES: tl.constexpr):
    # Everything one KV head reads of the sequence's block `index`: its K and V codes, K and V ranges, V outliers
    row_ptr = pool_ptr + tl.load(table_ptr + index).to(tl.int64) * row_bytes
    head_bytes: tl.constexpr = T * D * BITS // 8
    _prefetch_lines(row_ptr + kv_head * head_bytes, head_bytes, CODE_LINES)
    _prefetch_lines(row_ptr + v_codes_offset + kv_head * head_bytes, head_bytes, CODE_LINES)
    _prefetch_lines(row_ptr + k_low_offset + kv_head * D, D, RANGE_LINES)
    _prefetch_lines(row_ptr + k_high_offset + kv_head * D, D, RANGE_LINES)
    _prefetch_lines(row_ptr + v_center_offset, 4 * T, META_LINES)
    outliers = kv_head * num_outliers * 2
    _prefetch_lines(row_ptr + v_index_offset + outliers, num_outliers * 2, OUTLIER_LINES)
    _prefetch_lines(row_ptr + v_corr_offset + outliers, num_outliers * 2, OUTLIER_LINES)


_FUNCTIONS = (load_words, _pair, decode_groups, key_range, dense_keys, load_outliers, _prefetch_lines,
              prefetch_block)


def load_triton() -> None:
    """Import triton and jit the functions above (once); RuntimeError if triton is not installed."""
    global triton
    if triton is None:
        triton = jit_into(globals(), _FUNCTIONS)
