"""Fused Triton decode attention over kvquant-packed pool rows, and its checking launcher.

The reference it must match is `kernels.kvquant_attention.kvquant_decode_attention_ref`; the row layout is
`kernels.kvquant_layout`, the row-reading device functions `kernels.kvquant_rows_triton`. Triton is imported on the
first launch; the code keeps to the Triton 3.6 API (it also compiles with 3.9).

Design. Flash-decoding: the grid is (sequence, KV head, context split); one program holds every query head of its KV
head and runs an online softmax (base 2) over its share of the sequence's units (each packed block is a unit, the
fp16 tail one more; the sink goes to the split holding block 0); a small second kernel merges the splits' (max, sum,
unnormalised output). GQA rows are padded to 16 for tl.dot (USE_DOT); with one query head per KV head (MHA) the
products are elementwise in the K and V tiles' own layouts and summed (`_scores`, `_weighted`): no MMA padding rows,
no operand layout conversions. Per packed block it reads only that row's bytes:
- Codes are read as whole groups (8 codes, b bytes, at b = 3 or 4; else a byte) and looked up two at a time in a pair
  table (fp32 [4**b, 2], entry c1 << b | c0 = (codebook[c0], codebook[c1]), `KvQuantLayerParams.*_pair_codebook`): one
  8-byte load per adjacent codes 2k, 2k + 1, whose 2b bits in the group are the entry's index as they stand (one shift
  and mask), the loads joined and permuted into channel order (`decode_groups`). A key is codebook * half-range + centre
  of its channel's range in the block, which the block's K low and K high bytes place on the channel's grid (the grid's
  base and step, [D] fp32 each, are loaded once per program); centre and half-range are worked out once a channel in a
  compact layout and only then spread over the key tile (`key_range`).
- RoPE without a [T, D/2] table read per block: R(p0 + t) = R(p0) R(t), so the query is turned back by the block's
  base angle (one cos/sin row) and the keys rotated by the in-block offsets t < T, whose table rows stay in
  registers across blocks. (cos(a + b) by angle addition differs from the table's cos((p0 + t) theta) by the fp32
  rounding of the angle, about 1e-7 * position radians.) With one query row (MHA) range and rotation fold into six
  per-channel weights: per channel pair, qb . R(t) k = cos_t (u1 a1 + u2 a2 + x) + sin_t (u1 b1 - u2 b2 + y) (u the
  codebook units, a, b, x, y from R(p0)^T q and the block's ranges, worked out in `key_range`'s compact layout),
  6 FFMA a pair, the columns a thread holds summed by one FFMA chain (`rotated_dot`).
- V: the per-token range is folded into the probabilities, p * V = (p * half-range) @ codebook[codes] +
  (p . centre). In the MHA kernel the dense part is accumulated per token, acc_tile[t, d] += p[t'] * V[t', d] for
  the four tokens t' = t + i T / 4 a thread holds (one FFMA an element, the [T / 4, D] tile rescaled only when the
  running max moves) and summed over t once per program.
- Keys have no sparse outliers (the per-block range takes their place). Value outliers (n = ceil(1% * T * D) per
  head, index t * D + d and correction c, contiguous): all n are loaded in one pass per block, p gathered at their
  tokens (tl.gather), and w = p[t] * c scattered into the channels by one small dot, the channel split as
  d = 16 a + b: out[(row, a), b] = sum_j (w_j [a_j = a]) [b_j = b] (`kvquant_rows_triton._value_outliers`). No
  atomics, so the result is deterministic.
- 4 warps (about 250 registers a thread at T * D = 8192: two programs per SM; at 8 warps per-channel work and
  reductions are shared by more threads, costing more instructions a block), and the next AHEAD blocks' bytes are
  requested with PTX prefetches, one [8 sections, lines] tile of row offsets worked out once a program (on the GPU
  only), instead of Triton's software pipelining, which would also stage the codebook gathers in shared memory.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kernels import kvquant_rows_triton as rows_triton
from kernels.backend import jit_into, on_grid
from kernels.kvquant_layout import KvQuantLayerParams, KvQuantLayout, check_kernel_layout
from kernels.kvquant_rows_triton import (
    _dot,
    _value_outliers,
    decode_groups,
    dense_keys,
    key_range,
    load_words,
    prefetch_block,
    prefetch_offsets,
    rotated_dot,
)

triton: Any = None  # bound by _load_triton, as in kernels.paged_attention_triton
tl: Any = None


# ---- Triton kernels, jitted by _load_triton ----------------------------------------------------------------


def _scores(q, k, like_ptr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    # q [M, K], k [N, K] -> q @ k^T [M, N]: tl.dot (M >= 16), or for one query row (M = 1) the products summed in
    # k's own layout, which keeps the MMA's 15 padding rows and its operand conversions out of the MHA kernel
    if USE_DOT:
        return _dot(q, tl.trans(k), like_ptr, DOT_F32)
    else:
        return tl.sum(k * q, 1)[None, :]


def _weighted(p, v, like_ptr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    # p [M, N], v [N, K] -> p @ v [M, K], as `_scores`
    if USE_DOT:
        return _dot(p, v, like_ptr, DOT_F32)
    else:
        return tl.sum(tl.trans(p) * v, 0)[None, :]


def _softmax_step(m_i, l_i, scores):
    # Online softmax in base 2 over one tile of scores [M, N]: (new max, rescale of the old state, p, new sum)
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


def _packed_scores(
    q1, q2, qa, qn, cos_t, sin_t, row_ptr, blk, kv_head, key_pairs_ptr, base1, step1, base2, step2, cos_ptr, sin_ptr,
    k_low_offset, k_high_offset, like_ptr,
    BITS: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # [M, T]: q . R(p0 + t) k_t for the block at positions p0 = blk * T onwards; block 0's token 0 (the sink) masked
    half_dims = tl.arange(0, D // 2)
    p0 = blk * T
    if USE_DOT:
        c0 = tl.load(cos_ptr + p0 * (D // 2) + half_dims)[None, :]
        s0 = tl.load(sin_ptr + p0 * (D // 2) + half_dims)[None, :]
        qb1, qb2 = q1 * c0 + q2 * s0, q2 * c0 - q1 * s0  # R(p0)^T q
        k1 = dense_keys(row_ptr, key_pairs_ptr, k_low_offset, k_high_offset, base1, step1, kv_head, 0, BITS, GROUP,
                        T, D)
        k2 = dense_keys(row_ptr, key_pairs_ptr, k_low_offset, k_high_offset, base2, step2, kv_head, 1, BITS, GROUP,
                        T, D)
        kr1, kr2 = k1 * cos_t - k2 * sin_t, k2 * cos_t + k1 * sin_t  # R(t) k
        scores = _scores(qb1, kr1, like_ptr, USE_DOT, DOT_F32) + _scores(qb2, kr2, like_ptr, USE_DOT, DOT_F32)
    else:
        # One query row: qb = R(p0)^T q, key k = u * h + m (codebook units u, the block's range), and per channel
        # pair qb . R(t) k = cos_t (u1 a1 + u2 a2 + x) + sin_t (u1 b1 - u2 b2 + y), the six per-channel weights
        # worked out once a channel in key_range's compact [D / 2, 2] layout (R(p0)^T q by the same reduction)
        side = tl.arange(0, 2)[None, :]
        angle = p0 * (D // 2) + half_dims[:, None]
        cs0 = tl.load(tl.where(side == 0, cos_ptr + angle, sin_ptr + angle))  # [D / 2, 2]: cos, sin of p0
        qb1, qb2 = tl.sum(qa * cs0, 1), tl.sum(qn * cs0, 1)
        m1, h1 = key_range(row_ptr, k_low_offset, k_high_offset, base1, step1, kv_head, 0, D)
        m2, h2 = key_range(row_ptr, k_low_offset, k_high_offset, base2, step2, kv_head, 1, D)
        a1, a2, b1, b2 = qb1 * h1, qb2 * h2, qb2 * h1, qb1 * h2
        x, y = qb1 * m1 + qb2 * m2, qb2 * m1 - qb1 * m2
        u1 = dense_keys(row_ptr, key_pairs_ptr, k_low_offset, k_high_offset, base1, step1, kv_head, 0, BITS, GROUP,
                        T, D, False)
        u2 = dense_keys(row_ptr, key_pairs_ptr, k_low_offset, k_high_offset, base2, step2, kv_head, 1, BITS, GROUP,
                        T, D, False)
        kc = u1 * a1[None, :] + (u2 * a2[None, :] + x[None, :])
        ks = u1 * b1[None, :] - (u2 * b2[None, :] - y[None, :])
        scores = rotated_dot(cos_t, kc, sin_t, ks, GROUP)[None, :]
    return tl.where((tl.arange(0, T)[None, :] == 0) & (blk == 0), float("-inf"), scores)


def _packed_values(
    p, alpha, acc_tile, row_ptr, row16_ptr, kv_head, value_pairs_ptr, num_outliers, v_codes_offset, v_center_offset,
    v_scale_offset, v_index_offset, v_corr_offset, like_ptr,
    BITS: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
    N_PAD: tl.constexpr, HAS_OUTLIERS: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
):
    # p @ V for one packed block, V = codebook[code] * half-range[t] + centre[t] (+ outlier corrections): returns
    # (acc_tile, pv [M, D]). With tl.dot all of it is in pv; for one row (M = 1) the dense part is accumulated
    # per token instead, acc_tile [T / 4, D] = acc_tile * alpha + sum_i p[t'] * V[t', d] over the four tokens
    # t' = t + i T / 4, summed over t once per program (one FFMA an element; the rescale only when the max moved)
    toks = tl.arange(0, T)
    v_center = tl.load(row16_ptr + v_center_offset // 2 + toks).to(tl.float32)
    v_scale = tl.load(row16_ptr + v_scale_offset // 2 + toks).to(tl.float32)
    word_index = (kv_head * T + toks[:, None]) * (D // GROUP) + tl.arange(0, D // GROUP)[None, :]
    v_units = decode_groups(load_words(row_ptr + v_codes_offset, word_index, BITS), value_pairs_ptr, BITS, GROUP)
    pv = tl.sum(p * v_center[None, :], 1)[:, None]
    if USE_DOT:
        pv += _dot(p * v_scale[None, :], v_units, like_ptr, DOT_F32)
    else:
        if tl.max(alpha, 0) != 1.0:
            acc_tile = acc_tile * alpha[:, None]
        # tokens t + i T / 4 (i < 4) share row t of the tile: split apart in registers, added by one FFMA chain
        w01, w23 = tl.split(tl.permute(tl.reshape(tl.trans(p * v_scale[None, :]), [2, 2, T // 4, 1]), (2, 3, 0, 1)))
        v01, v23 = tl.split(tl.permute(tl.reshape(v_units, [2, 2, T // 4, D]), (2, 3, 0, 1)))
        (w0, w1), (v0, v1), (w2, w3), (v2, v3) = tl.split(w01), tl.split(v01), tl.split(w23), tl.split(v23)
        acc_tile = ((acc_tile + w0 * v0) + w1 * v1) + w2 * v2
        acc_tile = acc_tile + w3 * v3
    if HAS_OUTLIERS:
        pv += _value_outliers(p, row16_ptr, kv_head, num_outliers, v_index_offset, v_corr_offset, like_ptr, M, T, D,
                              N_PAD, DOT_F32)
    return acc_tile, pv


def _kvquant_decode_kernel(
    part_ptr, stats_ptr, q_ptr, pool_ptr, pool16_ptr, table_ptr, num_packed_ptr,
    tail_k_ptr, tail_v_ptr, tail_lens_ptr, sink_k_ptr, sink_v_ptr,
    key_pairs_ptr, grid_base_ptr, grid_step_ptr, value_pairs_ptr, cos_ptr, sin_ptr, qk_scale,
    groups, num_outliers, units_per_split, num_splits, row_bytes, stride_table,
    stride_qb, stride_qh, stride_tail_b, stride_tail_h, stride_sink_b, stride_sink_h,
    v_codes_offset, k_low_offset, k_high_offset, v_center_offset, v_scale_offset, v_index_offset, v_corr_offset,
    BITS: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, M_PAD: tl.constexpr,
    N_PAD: tl.constexpr, HAS_OUTLIERS: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    PREFETCH: tl.constexpr, AHEAD: tl.constexpr, LINES: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, toks, dims, half_dims = tl.arange(0, M_PAD), tl.arange(0, T), tl.arange(0, D), tl.arange(0, D // 2)
    row_ok = rows < groups
    q_rows_ptr = q_ptr + seq * stride_qb + (kv_head * groups + rows)[:, None] * stride_qh  # [M_PAD, 1]
    q = tl.load(q_rows_ptr + dims[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    q1 = tl.load(q_rows_ptr + half_dims[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(q_rows_ptr + D // 2 + half_dims[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    pair_side = half_dims[:, None] + tl.arange(0, 2)[None, :] * (D // 2)  # [D/2, 2]: (q1, q2) and (q2, -q1)
    q_row_ptr = q_ptr + seq * stride_qb + kv_head * groups * stride_qh
    qa = tl.load(q_row_ptr + pair_side).to(tl.float32) * qk_scale  # one query row (MHA): `_packed_scores`
    qn = tl.load(q_row_ptr + (pair_side + D // 2) % D).to(tl.float32) * (qk_scale * (1 - 2 * tl.arange(0, 2)))
    offset_table = toks[:, None] * (D // 2) + half_dims[None, :]
    cos_t, sin_t = tl.load(cos_ptr + offset_table), tl.load(sin_ptr + offset_table)  # [T, D/2]: R(t), t < T
    grid = kv_head * D + half_dims  # the head's key grids, [D/2] per half, for every block
    base1, step1 = tl.load(grid_base_ptr + grid), tl.load(grid_step_ptr + grid)
    base2, step2 = tl.load(grid_base_ptr + D // 2 + grid), tl.load(grid_step_ptr + D // 2 + grid)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)
    TILE_T: tl.constexpr = 1 if USE_DOT else T // 4
    acc_tile = tl.zeros([TILE_T, D], tl.float32)  # one row: p * V of the packed blocks (`_packed_values`)
    num_packed, tail_len = tl.load(num_packed_ptr + seq), tl.load(tail_lens_ptr + seq)
    first = split * units_per_split
    last = tl.minimum(first + units_per_split, num_packed + 1)  # units: the packed blocks, then the tail

    if (first == 0) & (num_packed > 0):  # the sink first: token 0, whole, at position 0 (no rotation)
        sink = seq * stride_sink_b + kv_head * stride_sink_h + dims
        k_sink, v_sink = tl.load(sink_k_ptr + sink).to(tl.float32), tl.load(sink_v_ptr + sink).to(tl.float32)
        m_i, l_i, acc = tl.sum(q * k_sink[None, :], 1), l_i + 1.0, acc + v_sink[None, :]

    end = tl.minimum(last, num_packed)
    table_ptr += seq * stride_table
    if PREFETCH:  # AHEAD blocks in flight: at two programs per SM little else hides the latency of HBM
        lines = prefetch_offsets(kv_head, num_outliers, v_codes_offset, k_low_offset, k_high_offset, v_center_offset,
                                 v_index_offset, v_corr_offset, BITS, T, D, LINES)
        if end > first:
            for ahead in tl.static_range(AHEAD - 1):
                prefetch_block(table_ptr, tl.minimum(first + ahead, end - 1), pool_ptr, row_bytes, lines)
    for blk in range(first, end):
        if PREFETCH:
            prefetch_block(table_ptr, tl.minimum(blk + AHEAD - 1, end - 1), pool_ptr, row_bytes, lines)
        block_id = tl.load(table_ptr + blk).to(tl.int64)
        row_ptr, row16_ptr = pool_ptr + block_id * row_bytes, pool16_ptr + block_id * (row_bytes // 2)
        scores = _packed_scores(
            q1, q2, qa, qn, cos_t, sin_t, row_ptr, blk, kv_head, key_pairs_ptr, base1, step1, base2, step2, cos_ptr,
            sin_ptr, k_low_offset, k_high_offset, tail_k_ptr, BITS, GROUP, T, D, USE_DOT, DOT_F32,
        )
        m_i, alpha, p, l_i = _softmax_step(m_i, l_i, scores)
        acc_tile, pv = _packed_values(
            p, alpha, acc_tile, row_ptr, row16_ptr, kv_head, value_pairs_ptr, num_outliers, v_codes_offset,
            v_center_offset, v_scale_offset, v_index_offset, v_corr_offset, tail_k_ptr, BITS, GROUP, T, D, M_PAD, N_PAD,
            HAS_OUTLIERS, USE_DOT, DOT_F32,
        )
        acc = acc * alpha[:, None] + pv

    if not USE_DOT:
        acc += tl.sum(acc_tile, 0)[None, :]
    if (first <= num_packed) & (num_packed < last) & (tail_len > 0):  # the fp16 tail, keys already rotated
        tail = seq * stride_tail_b + kv_head * stride_tail_h + toks[:, None] * D + dims[None, :]
        is_tail = toks < tail_len
        k = tl.load(tail_k_ptr + tail, mask=is_tail[:, None], other=0.0)
        v = tl.load(tail_v_ptr + tail, mask=is_tail[:, None], other=0.0)
        scores = tl.where(is_tail[None, :], _scores(q, k, tail_k_ptr, USE_DOT, DOT_F32), float("-inf"))
        m_i, alpha, p, l_i = _softmax_step(m_i, l_i, scores)
        acc = acc * alpha[:, None] + _weighted(p, v, tail_k_ptr, USE_DOT, DOT_F32)

    # Partials [batch, num_heads, num_splits, D] and [..., 2] = (max, sum); an idle split leaves (-inf, 0, 0).
    part = ((seq * tl.num_programs(1) + kv_head) * groups + rows) * num_splits + split
    tl.store(part_ptr + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])
    tl.store(stats_ptr + part * 2, m_i, mask=row_ok)
    tl.store(stats_ptr + part * 2 + 1, l_i, mask=row_ok)


def _merge_splits_kernel(
    out_ptr, part_ptr, stats_ptr, num_heads, num_splits, stride_ob, stride_oh,
    D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    splits, dims = tl.arange(0, SPLITS_PAD), tl.arange(0, D)
    is_split = splits < num_splits
    part = (seq * num_heads + head) * num_splits + splits
    m = tl.load(stats_ptr + part * 2, mask=is_split, other=float("-inf"))
    denom = tl.load(stats_ptr + part * 2 + 1, mask=is_split, other=0.0)
    acc = tl.load(part_ptr + part[:, None] * D + dims[None, :], mask=is_split[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_max)
    total = tl.sum(weight * denom, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


_KERNELS = (_scores, _weighted, _softmax_step, _packed_scores, _packed_values, _kvquant_decode_kernel,
            _merge_splits_kernel)
_ROW_FUNCTIONS = ("_dot", "_value_outliers", "load_words", "decode_groups", "rotated_dot", "key_range", "dense_keys",
                  "prefetch_offsets", "prefetch_block")


def _load_triton() -> None:
    """Import triton and jit the kernels above; RuntimeError if triton is not installed."""
    global triton
    rows_triton.load_triton()
    for name in _ROW_FUNCTIONS:  # the jitted versions, under the names the kernels call
        globals()[name] = getattr(rows_triton, name)
    triton = jit_into(globals(), _KERNELS)


# ---- Launcher ----------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_PROGRAMS_PER_SM = 8  # splits until the grid is several waves deep; each split adds a [D] fp32 partial
_MIN_UNITS_PER_SPLIT = 16  # blocks per split at least (1k tokens at T = 64): below that the merge costs more
_PREFETCH_AHEAD = 4  # packed blocks requested ahead of use (about 7 KB each at T = 64, D = 128, 3 bits)


def _require(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise ValueError(message)


def _check_decode_args(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, counts: tuple[torch.Tensor, ...],
                       dense: tuple[torch.Tensor, ...], params: KvQuantLayerParams) -> None:
    layout = params.layout
    check_kernel_layout(layout)
    heads, tokens, dim = layout.kv_heads, layout.block_size, layout.head_dim
    _require(q.dim() == 3 and q.dtype in _FLOAT_DTYPES and q.shape[2] == dim and q.shape[1] % heads == 0,
             f"q must be float [batch, k * {heads}, {dim}], got {q.dtype} {tuple(q.shape)}")
    batch = q.shape[0]
    _require(pool.dtype == torch.uint8 and pool.dim() == 2 and pool.shape[1] == layout.bytes_per_block
             and pool.is_contiguous(), f"packed_pool must be contiguous uint8 [num_blocks, {layout.bytes_per_block}]")
    _require(tables.dim() == 2 and tables.shape[0] == batch and tables.dtype in _INDEX_DTYPES,
             f"block_tables must be int [{batch}, max_blocks], got {tables.dtype} {tuple(tables.shape)}")
    for count in counts:
        _require(count.shape == (batch,) and count.dtype in _INDEX_DTYPES, f"counts must be int [{batch}]")
    tail_k, tail_v, sink_k, sink_v = dense
    _require(tail_k.shape == tail_v.shape == (batch, heads, tokens, dim) and tail_k.dtype == tail_v.dtype == q.dtype,
             f"tail_k, tail_v must be {q.dtype} [{batch}, {heads}, {tokens}, {dim}]")
    _require(sink_k.shape == sink_v.shape == (batch, heads, dim) and sink_k.dtype in _FLOAT_DTYPES,
             f"sink_k, sink_v must be float [{batch}, {heads}, {dim}]")
    _require(params.cos.shape[0] >= tokens, f"the RoPE tables must cover at least {tokens} positions")
    tensors = (q, pool, tables, *counts, *dense, params.key_grid_base, params.cos)
    devices = {t.device for t in tensors}
    _require(len(devices) == 1, f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")


def _prefetch_lines(layout: KvQuantLayout) -> int:
    """How many 128-byte lines the longest section one head reads of a block can touch (unaligned: one more)."""
    longest = max(layout.block_size * layout.head_dim * layout.bits // 8, 4 * layout.block_size,
                  2 * layout.num_outliers)
    return triton.next_power_of_2(-(-longest // 128) + 1)


def split_plan(batch: int, kv_heads: int, max_blocks: int, device: torch.device) -> tuple[int, int]:
    """(units per split, splits) the launcher picks: enough programs to fill the device several times over.

    A unit is a packed block or the tail; `max_blocks` is the block tables' width.
    """
    max_units = max_blocks + 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    splits = max(1, -(-_PROGRAMS_PER_SM * num_sms // (batch * kv_heads)))
    per_split = max(_MIN_UNITS_PER_SPLIT, -(-max_units // splits))
    return per_split, -(-max_units // per_split)


def kvquant_decode_attention_triton(
    q: torch.Tensor, packed_pool: torch.Tensor, block_tables: torch.Tensor, num_packed_blocks: torch.Tensor,
    tail_k: torch.Tensor, tail_v: torch.Tensor, tail_lens: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor,
    params: KvQuantLayerParams, scale: float, units_per_split: int | None = None,
) -> torch.Tensor:
    """Triton `kvquant_decode_attention_ref` (same arguments and result); `units_per_split` overrides the split size.

    Not checked (each would cost a device sync): block ids inside the pool, num_packed_blocks within the table,
    tail_lens <= block_size, cos/sin covering every packed position. A sequence with no token gets zeros.
    Raises:
        ValueError: on mismatched shapes, dtypes or devices, or a layout the kernel does not handle.
    """
    if triton is None:
        _load_triton()
    counts, dense = (num_packed_blocks, tail_lens), (tail_k, tail_v, sink_k, sink_v)
    _check_decode_args(q, packed_pool, block_tables, counts, dense, params)
    layout = params.layout
    batch, num_heads, dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    per_split = units_per_split or split_plan(batch, layout.kv_heads, block_tables.shape[1], q.device)[0]
    num_splits = -(-(block_tables.shape[1] + 1) // per_split)
    part = torch.empty(batch, num_heads, num_splits, dim, dtype=torch.float32, device=q.device)
    stats = torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    q = q if q.stride(2) == 1 else q.contiguous()
    tail_k, tail_v, sink_k, sink_v = (t.contiguous() for t in dense)  # no copies for the engine's buffers
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    group = 8 if layout.bits == 4 else math.lcm(layout.bits, 8) // layout.bits  # `load_words`: 4 bits, 4 bytes
    groups = num_heads // layout.kv_heads
    m_pad = triton.next_power_of_2(groups)
    on_grid(_kvquant_decode_kernel, (batch, layout.kv_heads, num_splits))(
        part, stats, q, packed_pool, packed_pool.view(torch.float16), tables, num_packed_blocks.contiguous(),
        tail_k, tail_v, tail_lens.contiguous(), sink_k, sink_v,
        params.key_pair_codebook, params.key_grid_base, params.key_grid_step, params.value_pair_codebook,
        params.cos, params.sin,
        scale * math.log2(math.e),
        groups, layout.num_outliers, per_split, num_splits, layout.bytes_per_block, tables.stride(0),
        q.stride(0), q.stride(1), tail_k.stride(0), tail_k.stride(1), sink_k.stride(0), sink_k.stride(1),
        layout.v_codes_offset, layout.k_low_offset, layout.k_high_offset, layout.v_center_offset,
        layout.v_scale_offset, layout.v_index_offset, layout.v_corr_offset,
        BITS=layout.bits, GROUP=group, T=layout.block_size, D=dim, M_PAD=1 if groups == 1 else max(16, m_pad),
        N_PAD=max(16, triton.next_power_of_2(layout.num_outliers)), HAS_OUTLIERS=layout.num_outliers > 0,
        USE_DOT=groups > 1,
        DOT_F32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type == "cpu"),
        PREFETCH=q.device.type == "cuda", AHEAD=_PREFETCH_AHEAD, LINES=_prefetch_lines(layout),
        num_warps=4,  # about 250 registers a thread: two programs an SM
        num_stages=1,  # the prefetch keeps blocks in flight; the pipeliner would stage the codebook gathers too
    )
    on_grid(_merge_splits_kernel, (batch, num_heads))(
        out, part, stats, num_heads, num_splits, out.stride(0), out.stride(1),
        D=dim, SPLITS_PAD=triton.next_power_of_2(num_splits),
    )
    return out
