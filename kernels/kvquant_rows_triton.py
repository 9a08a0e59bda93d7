"""Triton device functions reading one KV head's share of a kvquant pool row: code groups and their codebook entries
(two codes a load, from a pair table), the block's key channel ranges, the value outliers' scatter (`_value_outliers`,
by a small dot), the rotated query-key sum of the MHA scoring (`rotated_dot`), cache prefetches. Called by
`kernels.kvquant_attention_triton`, which jits them through `load_triton`; the row layout is `kernels.kvquant_layout`.
"""

from __future__ import annotations

from typing import Any

from kernels.backend import jit_into

triton: Any = None  # bound by load_triton, as in kernels.paged_attention_triton
tl: Any = None


def _dot(a, b, like_ptr, DOT_F32: tl.constexpr):
    # Operands in the query's dtype (fp16/bf16 MMA, fp32 accumulate); fp32 exact (the interpreter's bf16 too).
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(like_ptr.dtype.element_ty), b.to(like_ptr.dtype.element_ty))


def _value_outliers(p, row16_ptr, kv_head, num_outliers, v_index_offset, v_corr_offset, like_ptr,
                    M: tl.constexpr, T: tl.constexpr, D: tl.constexpr, N_PAD: tl.constexpr, DOT_F32: tl.constexpr):
    # [M, D]: p[t] * c added at channel d for each of the head's value outliers (t * D + d, c), all N_PAD (>= n) of
    # them in one pass. The weight w_j = p[t_j] * c_j is a gather of p; the scatter of w into the D channels is a
    # dot with the channel split as d = 16 a + b: out[(m, a), b] = sum_j (w[m, j] [a_j = a]) [b_j = b], two one-hots
    # of N_PAD * (M * D / 16 + 16) elements instead of N_PAD * D. Rows m >= M pad the dot to 16 rows.
    j = tl.arange(0, N_PAD)
    is_real = j < num_outliers
    at = kv_head * num_outliers + j
    index = tl.load(row16_ptr + v_index_offset // 2 + at, mask=is_real, other=0.0).to(tl.int16, bitcast=True)
    index = index.to(tl.int32) & 0xFFFF  # uint16 t * D + d; padding: 0 with a zero correction
    corr = tl.load(row16_ptr + v_corr_offset // 2 + at, mask=is_real, other=0.0).to(tl.float32)
    w = tl.gather(p, tl.broadcast_to((index // D)[None, :], [M, N_PAD]), 1) * corr[None, :]  # [M, N_PAD]
    A: tl.constexpr = D // 16
    M_EFF: tl.constexpr = M if M * A >= 16 else 16 // A
    m3 = tl.arange(0, M_EFF)[:, None, None]
    a_hit = (index[None, None, :] // 16 % A == tl.arange(0, A)[None, :, None]) & (m3 < M)
    w_a = tl.reshape(tl.where(a_hit, w[:, None, :], 0.0), [M_EFF * A, N_PAD])
    b_hit = (index[:, None] % 16 == tl.arange(0, 16)[None, :]).to(tl.float32)  # [N_PAD, 16]
    out = tl.reshape(_dot(w_a, b_hit, like_ptr, DOT_F32), [M_EFF, D])
    if M_EFF != M:  # one real row: the padding rows are zero
        out = tl.sum(out, 0)[None, :]
    return out


def load_words(byte_ptr, word_index, BITS: tl.constexpr):
    # word_index [R, W] -> little-endian groups of codes, int32 [R, W]: at 3 and 4 bits 8 codes (BITS bytes: two
    # 4-bit groups of the layout's bytes a word, so GROUP = 8 takes the same adjacent-pair path as 3 bits, without
    # GROUP = 2's reshape through shared memory), else lcm(BITS, 8) bits (a byte)
    if BITS == 3 or BITS == 4:
        base = byte_ptr + word_index * BITS
        word = tl.load(base).to(tl.int32) | (tl.load(base + 1).to(tl.int32) << 8)
        word = word | (tl.load(base + 2).to(tl.int32) << 16)
        if BITS == 4:
            word = word | (tl.load(base + 3).to(tl.int32) << 24)
        return word
    else:
        return tl.load(byte_ptr + word_index).to(tl.int32)


def _pair(word, k: tl.constexpr, pair_ptr, BITS: tl.constexpr):
    # [R, W, 2]: the codebook entries of codes 2k and 2k + 1 of each group, one 8-byte load from the pair table; the
    # two codes' bits as they stand in the group are the pair's index (c1 << BITS | c0): one shift and mask
    pair: tl.constexpr = (1 << (2 * BITS)) - 1
    index = (word >> (2 * BITS * k)) & pair
    return tl.load(pair_ptr + index[:, :, None] * 2 + tl.arange(0, 2)[None, None, :])


def decode_groups(word, pair_ptr, BITS: tl.constexpr, GROUP: tl.constexpr):
    # Groups [R, W] -> codebook entries [R, W * GROUP], code i of a group at column i. pair_ptr: fp32 [4**BITS, 2],
    # entry c1 << BITS | c0 = (codebook[c0], codebook[c1]) (`pair_codebook`), so one load serves two adjacent codes
    # 2k + e (e the loaded axis) and their index is a plain bit field of the group (adjacent pairs rather than k,
    # k + GROUP / 2: about a quarter fewer instructions an entry; a thread's registers no longer run in channel
    # order). The pairs k = 2 kh + kl are joined kh first, and a permute (no data movement) puts the axes in
    # channel order 4 kh + 2 kl + e for the reshape
    if GROUP == 2:
        values = _pair(word, 0, pair_ptr, BITS)
    elif GROUP == 4:
        values = tl.permute(tl.join(_pair(word, 0, pair_ptr, BITS), _pair(word, 1, pair_ptr, BITS)),
                            (0, 1, 3, 2))
    else:
        even = tl.join(_pair(word, 0, pair_ptr, BITS), _pair(word, 2, pair_ptr, BITS))
        odd = tl.join(_pair(word, 1, pair_ptr, BITS), _pair(word, 3, pair_ptr, BITS))
        values = tl.permute(tl.join(even, odd), (0, 1, 3, 4, 2))  # [R, W, e, kh, kl] -> [R, W, kh, kl, e]
    return tl.reshape(values, [word.shape[0], word.shape[1] * GROUP])


def rotated_dot(c, k, s, n, GROUP: tl.constexpr):
    # sum over columns of c * k + s * n, [R, C] tiles from `decode_groups` -> [R]: the columns a thread holds (a
    # group's, channel 4 kh + 2 kl + e) split apart by reshapes and splits (no data movement) and added by
    # one FFMA chain, instead of a multiply, an FFMA and an add a column
    if GROUP == 8:
        shape: tl.constexpr = [c.shape[0], c.shape[1] // 8, 2, 2, 2]
        (c01, c23), (k01, k23) = tl.split(tl.reshape(c, shape)), tl.split(tl.reshape(k, shape))
        (s01, s23), (n01, n23) = tl.split(tl.reshape(s, shape)), tl.split(tl.reshape(n, shape))
        (c0, c1), (c2, c3), (k0, k1), (k2, k3) = tl.split(c01), tl.split(c23), tl.split(k01), tl.split(k23)
        (s0, s1), (s2, s3), (n0, n1), (n2, n3) = tl.split(s01), tl.split(s23), tl.split(n01), tl.split(n23)
        part = c1 * k1 + (s1 * n1 + (c0 * k0 + s0 * n0))
        part = c3 * k3 + (s3 * n3 + (c2 * k2 + (s2 * n2 + part)))
        return tl.sum(tl.sum(part, 2), 1)
    elif GROUP == 4:
        shape4: tl.constexpr = [c.shape[0], c.shape[1] // 4, 2, 2]
        (c0, c1), (k0, k1) = tl.split(tl.reshape(c, shape4)), tl.split(tl.reshape(k, shape4))
        (s0, s1), (n0, n1) = tl.split(tl.reshape(s, shape4)), tl.split(tl.reshape(n, shape4))
        return tl.sum(tl.sum(c1 * k1 + (s1 * n1 + (c0 * k0 + s0 * n0)), 2), 1)
    else:
        return tl.sum(c * k + s * n, 1)


def key_range(row_ptr, k_low_offset, k_high_offset, base, step, kv_head, HALF: tl.constexpr, D: tl.constexpr):
    # One half of a head's key channels in the block: centre and half-range [D / 2], fp32, from the row's K low and
    # K high grid points and the channels' grid base, step [D / 2] (`kernels.kvquant_format.block_key_range`).
    # Worked out on a [D / 2, 2] tile of the two ends and summed over them: the reduction keeps this in a compact
    # layout (a channel or two a thread) and the key tile's layout gets only the result, instead of every thread
    # redoing the arithmetic for each channel it holds
    at = kv_head * D + HALF * (D // 2) + tl.arange(0, D // 2)
    side = tl.arange(0, 2)[None, :]
    ends = tl.load(row_ptr + tl.where(side == 0, k_low_offset, k_high_offset) + at[:, None]).to(tl.float32)
    terms = ends * (step * 0.5)[:, None]
    return tl.sum(terms + (base * 0.5)[:, None], 1), tl.sum(terms * (side * 2 - 1).to(tl.float32), 1)


def dense_keys(row_ptr, key_pairs_ptr, k_low_offset, k_high_offset, base, step, kv_head, HALF: tl.constexpr,
               BITS: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, APPLY: tl.constexpr = True):
    # One half (HALF = 0 or 1) of a head's pre-RoPE keys [T, D / 2], fp32: codebook[code] * half-range + centre in
    # each channel, by the block's own range (`key_range`); base, step [D / 2]: that half's grid; key_pairs_ptr: the
    # key codebook's pair table (`decode_groups`)
    words: tl.constexpr = D // 2 // GROUP
    toks, cols = tl.arange(0, T), tl.arange(0, words)
    word_index = (kv_head * T + toks[:, None]) * (D // GROUP) + HALF * words + cols[None, :]
    units = decode_groups(load_words(row_ptr, word_index, BITS), key_pairs_ptr, BITS, GROUP)
    if APPLY:
        center, half = key_range(row_ptr, k_low_offset, k_high_offset, base, step, kv_head, HALF, D)
        units = units * half[None, :] + center[None, :]
    return units


def prefetch_offsets(kv_head, num_outliers, v_codes_offset, k_low_offset, k_high_offset, v_center_offset,
                     v_index_offset, v_corr_offset, BITS: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
                     LINES: tl.constexpr):
    # [8, LINES] byte offsets in a pool row of every 128-byte line one KV head reads of a block (`prefetch_block`):
    # its K and V codes, K low and high, V centre and half-range, V outlier index and corrections, a section a row
    # (LINES covers the longest, unaligned). The same for every block: worked out once a program
    head_bytes: tl.constexpr = T * D * BITS // 8
    sec = tl.arange(0, 8)[:, None]
    outliers = kv_head * num_outliers * 2
    start = tl.where(sec == 0, kv_head * head_bytes, tl.where(sec == 1, v_codes_offset + kv_head * head_bytes,
            tl.where(sec == 2, k_low_offset + kv_head * D, tl.where(sec == 3, k_high_offset + kv_head * D,
            tl.where(sec == 4, v_center_offset, tl.where(sec == 5, v_index_offset, v_corr_offset) + outliers)))))
    size = tl.where(sec < 2, head_bytes, tl.where(sec < 4, D, tl.where(sec == 4, 4 * T, num_outliers * 2)))
    return start + tl.minimum(tl.arange(0, LINES)[None, :] * 128, tl.maximum(size - 1, 0))


def prefetch_block(table_ptr, index, pool_ptr, row_bytes, offsets):
    # A cache hint for each of the row offsets [8, LINES] (`prefetch_offsets`) of the sequence's block `index`: a
    # prefetch instruction or two a thread. PTX, so GPU only (the interpreter cannot run inline assembly; the
    # kernels skip this there)
    addr = pool_ptr + tl.load(table_ptr + index).to(tl.int64) * row_bytes + offsets
    tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                              is_pure=False, pack=1)


_FUNCTIONS = (_dot, _value_outliers, load_words, _pair, decode_groups, rotated_dot, key_range, dense_keys,
              prefetch_offsets, prefetch_block)


def load_triton() -> None:
    """Import triton and jit the functions above (once); RuntimeError if triton is not installed."""
    global triton
    if triton is None:
        triton = jit_into(globals(), _FUNCTIONS)
