"""Fused Triton decode attention over kvquant-packed pool rows, and its checking launcher.

The reference it must match is `kernels.kvquant_attention.kvquant_decode_attention_ref`; the row layout is
`kernels.kvquant_layout`, the row-reading device functions `kernels.kvquant_rows_triton`. Triton is imported on the
first launch; the code keeps to the Triton 3.6 API (it also compiles with 3.9).

Design. Flash-decoding: the grid is (sequence, KV head, context split); one program holds every query head of its KV
head (GQA rows, padded to 16 for tl.dot) and runs an online softmax (base 2) over its share of the sequence's units
(each packed block is a unit, the fp16 tail one more; the sink goes to the split holding block 0); a small second
kernel merges the splits' (max, sum, unnormalised output). Per packed block it reads only that row's bytes:
- Codes are read as whole lcm(b, 8)-bit groups and looked up in the bare codebooks in the groups' own layout, then
  interleaved back with tl.join. A key is codebook * half-range + centre of its channel's range in the block, which
  the block's K low and K high bytes place on the channel's grid: one load of 2 * D bytes per block and KV head (the
  grid's base and step, [D] fp32 each, are loaded once per program).
- RoPE without a [T, D/2] table read per block: R(p0 + t) = R(p0) R(t), so the query is turned back by the block's
  base angle (one cos/sin row) and the keys rotated by the in-block offsets t < T, whose table rows stay in
  registers across blocks. (cos(a + b) by angle addition differs from the table's cos((p0 + t) theta) by the fp32
  rounding of the angle, about 1e-7 * position radians.)
- V: the per-token range is folded into the probabilities, p * V = (p * half-range) @ codebook[codes] +
  (p . centre).
- Keys have no sparse outliers (the per-block range takes their place). Value outliers (n = ceil(1% * T * D) per
  head): their effect is applied where it lands rather than scattered into the dense tile (a [n, T * D] one-hot): a
  correction c at (t, d) adds p[t] * c to out[d], through [32, T] and [32, D] one-hots fed to tl.dot, 32 outliers at
  a time. O(n * (T + D)) per block, no second pass over memory and no atomics, so the result is deterministic.
- 8 warps at T * D = 8192 (about 250 registers a thread, one program per SM), so the next AHEAD blocks' bytes are
  requested with PTX prefetches (on the GPU only) instead of Triton's software pipelining, which would also stage
  the codebook gathers in shared memory.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kernels import kvquant_rows_triton as rows_triton
from kernels.backend import jit_into, on_grid
from kernels.kvquant_layout import KvQuantLayerParams, KvQuantLayout, check_kernel_layout
from kernels.kvquant_rows_triton import decode_groups, dense_keys, load_outliers, load_words, prefetch_block

triton: Any = None  # bound by _load_triton, as in kernels.paged_attention_triton
tl: Any = None


# ---- Triton kernels, jitted by _load_triton ----------------------------------------------------------------


def _dot(a, b, like_ptr, DOT_F32: tl.constexpr):
    # Operands in the query's dtype (fp16/bf16 MMA, fp32 accumulate); fp32 exact (the interpreter's bf16 too).
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(like_ptr.dtype.element_ty), b.to(like_ptr.dtype.element_ty))


def _value_outlier_output(p, tok, dim, corr, like_ptr, T: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr):
    # [M, D]: p[t] * corr added at channel d for each value outlier (t, d)
    p_at = _dot(p, tl.arange(0, T)[:, None] == tok[None, :], like_ptr, DOT_F32)  # [M, CHUNK]
    return _dot(p_at * corr[None, :], dim[:, None] == tl.arange(0, D)[None, :], like_ptr, DOT_F32)


def _softmax_step(m_i, l_i, scores):
    # Online softmax in base 2 over one tile of scores [M, N]: (new max, rescale of the old state, p, new sum)
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


def _packed_scores(
    q1, q2, cos_t, sin_t, row_ptr, blk, kv_head, key_cb_ptr, base1, step1, base2, step2, cos_ptr, sin_ptr,
    k_low_offset, k_high_offset, like_ptr,
    BITS: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr,
):
    # [M, T]: q . R(p0 + t) k_t for the block at positions p0 = blk * T onwards; block 0's token 0 (the sink) masked
    half_dims = tl.arange(0, D // 2)
    p0 = blk * T
    c0 = tl.load(cos_ptr + p0 * (D // 2) + half_dims)[None, :]
    s0 = tl.load(sin_ptr + p0 * (D // 2) + half_dims)[None, :]
    qb1, qb2 = q1 * c0 + q2 * s0, q2 * c0 - q1 * s0  # R(p0)^T q
    k1 = dense_keys(row_ptr, key_cb_ptr, k_low_offset, k_high_offset, base1, step1, kv_head, 0, BITS, GROUP, T, D)
    k2 = dense_keys(row_ptr, key_cb_ptr, k_low_offset, k_high_offset, base2, step2, kv_head, 1, BITS, GROUP, T, D)
    kr1, kr2 = k1 * cos_t - k2 * sin_t, k2 * cos_t + k1 * sin_t  # R(t) k
    scores = _dot(qb1, tl.trans(kr1), like_ptr, DOT_F32) + _dot(qb2, tl.trans(kr2), like_ptr, DOT_F32)
    return tl.where((tl.arange(0, T)[None, :] == 0) & (blk == 0), float("-inf"), scores)


def _packed_values(
    p, row_ptr, row16_ptr, kv_head, value_cb_ptr, num_outliers, v_codes_offset, v_center_offset, v_scale_offset,
    v_index_offset, v_corr_offset, like_ptr,
    BITS: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
    HAS_OUTLIERS: tl.constexpr, DOT_F32: tl.constexpr,
):
    # [M, D]: p @ V for one packed block, V = codebook[code] * half-range[t] + centre[t] (+ outlier corrections)
    toks = tl.arange(0, T)
    v_center = tl.load(row16_ptr + v_center_offset // 2 + toks).to(tl.float32)
    v_scale = tl.load(row16_ptr + v_scale_offset // 2 + toks).to(tl.float32)
    word_index = (kv_head * T + toks[:, None]) * (D // GROUP) + tl.arange(0, D // GROUP)[None, :]
    v_units = decode_groups(load_words(row_ptr + v_codes_offset, word_index, BITS), value_cb_ptr, BITS, GROUP, 1, 0)
    pv = _dot(p * v_scale[None, :], v_units, like_ptr, DOT_F32) + tl.sum(p * v_center[None, :], 1)[:, None]
    if HAS_OUTLIERS:
        for start in range(0, num_outliers, CHUNK):
            tok, dim, corr = load_outliers(row16_ptr, v_index_offset, v_corr_offset, kv_head, num_outliers, start,
                                           D, CHUNK)
            pv += _value_outlier_output(p, tok, dim, corr, like_ptr, T, D, DOT_F32)
    return pv


def _kvquant_decode_kernel(
    part_ptr, stats_ptr, q_ptr, pool_ptr, pool16_ptr, table_ptr, num_packed_ptr,
    tail_k_ptr, tail_v_ptr, tail_lens_ptr, sink_k_ptr, sink_v_ptr,
    key_cb_ptr, grid_base_ptr, grid_step_ptr, value_cb_ptr, cos_ptr, sin_ptr, qk_scale,
    groups, num_outliers, units_per_split, num_splits, row_bytes, stride_table,
    stride_qb, stride_qh, stride_tail_b, stride_tail_h, stride_sink_b, stride_sink_h,
    v_codes_offset, k_low_offset, k_high_offset, v_center_offset, v_scale_offset, v_index_offset, v_corr_offset,
    BITS: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, M_PAD: tl.constexpr,
    CHUNK: tl.constexpr, HAS_OUTLIERS: tl.constexpr, DOT_F32: tl.constexpr, PREFETCH: tl.constexpr,
    AHEAD: tl.constexpr, CODE_LINES: tl.constexpr, RANGE_LINES: tl.constexpr, META_LINES: tl.constexpr,
    OUTLIER_LINES: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, toks, dims, half_dims = tl.arange(0, M_PAD), tl.arange(0, T), tl.arange(0, D), tl.arange(0, D // 2)
    row_ok = rows < groups
    q_rows_ptr = q_ptr + seq * stride_qb + (kv_head * groups + rows)[:, None] * stride_qh  # [M_PAD, 1]
    q = tl.load(q_rows_ptr + dims[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    q1 = tl.load(q_rows_ptr + half_dims[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(q_rows_ptr + D // 2 + half_dims[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    offset_table = toks[:, None] * (D // 2) + half_dims[None, :]
    cos_t, sin_t = tl.load(cos_ptr + offset_table), tl.load(sin_ptr + offset_table)  # [T, D/2]: R(t), t < T
    grid = kv_head * D + half_dims  # the head's key grids, [D/2] per half, for every block
    base1, step1 = tl.load(grid_base_ptr + grid), tl.load(grid_step_ptr + grid)
    base2, step2 = tl.load(grid_base_ptr + D // 2 + grid), tl.load(grid_step_ptr + D // 2 + grid)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)
    num_packed, tail_len = tl.load(num_packed_ptr + seq), tl.load(tail_lens_ptr + seq)
    first = split * units_per_split
    last = tl.minimum(first + units_per_split, num_packed + 1)  # units: the packed blocks, then the tail

    if (first == 0) & (num_packed > 0):  # the sink first: token 0, whole, at position 0 (no rotation)
        sink = seq * stride_sink_b + kv_head * stride_sink_h + dims
        k_sink, v_sink = tl.load(sink_k_ptr + sink).to(tl.float32), tl.load(sink_v_ptr + sink).to(tl.float32)
        m_i, l_i, acc = tl.sum(q * k_sink[None, :], 1), l_i + 1.0, acc + v_sink[None, :]

    end = tl.minimum(last, num_packed)
    table_ptr += seq * stride_table
    if PREFETCH:  # AHEAD blocks in flight: at one program per SM nothing else hides the latency of HBM
        if end > first:
            for ahead in tl.static_range(AHEAD - 1):
                prefetch_block(table_ptr, tl.minimum(first + ahead, end - 1), pool_ptr, row_bytes, kv_head,
                               num_outliers, v_codes_offset, k_low_offset, k_high_offset, v_center_offset,
                               v_index_offset, v_corr_offset, BITS, T, D, CODE_LINES, RANGE_LINES, META_LINES,
                               OUTLIER_LINES)
    for blk in range(first, end):
        if PREFETCH:
            prefetch_block(table_ptr, tl.minimum(blk + AHEAD - 1, end - 1), pool_ptr, row_bytes, kv_head,
                           num_outliers, v_codes_offset, k_low_offset, k_high_offset, v_center_offset,
                           v_index_offset, v_corr_offset, BITS, T, D, CODE_LINES, RANGE_LINES, META_LINES,
                           OUTLIER_LINES)
        block_id = tl.load(table_ptr + blk).to(tl.int64)
        row_ptr, row16_ptr = pool_ptr + block_id * row_bytes, pool16_ptr + block_id * (row_bytes // 2)
        scores = _packed_scores(
            q1, q2, cos_t, sin_t, row_ptr, blk, kv_head, key_cb_ptr, base1, step1, base2, step2, cos_ptr, sin_ptr,
            k_low_offset, k_high_offset, tail_k_ptr, BITS, GROUP, T, D, DOT_F32,
        )
        m_i, alpha, p, l_i = _softmax_step(m_i, l_i, scores)
        pv = _packed_values(
            p, row_ptr, row16_ptr, kv_head, value_cb_ptr, num_outliers, v_codes_offset, v_center_offset,
            v_scale_offset, v_index_offset, v_corr_offset, tail_k_ptr, BITS, GROUP, T, D, CHUNK, HAS_OUTLIERS,
            DOT_F32,
        )
        acc = acc * alpha[:, None] + pv

    if (first <= num_packed) & (num_packed < last) & (tail_len > 0):  # the fp16 tail, keys already rotated
        tail = seq * stride_tail_b + kv_head * stride_tail_h + toks[:, None] * D + dims[None, :]
        is_tail = toks < tail_len
        k = tl.load(tail_k_ptr + tail, mask=is_tail[:, None], other=0.0)
        v = tl.load(tail_v_ptr + tail, mask=is_tail[:, None], other=0.0)
        scores = tl.where(is_tail[None, :], _dot(q, tl.trans(k), tail_k_ptr, DOT_F32), float("-inf"))
        m_i, alpha, p, l_i = _softmax_step(m_i, l_i, scores)
        acc = acc * alpha[:, None] + _dot(p, v, tail_k_ptr, DOT_F32)

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


_KERNELS = (_dot, _value_outlier_output, _softmax_step, _packed_scores, _packed_values,
            _kvquant_decode_kernel, _merge_splits_kernel)
_ROW_FUNCTIONS = ("load_words", "decode_groups", "dense_keys", "load_outliers", "prefetch_block")


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


def _prefetch_lines_meta(layout: KvQuantLayout) -> dict[str, int]:
    """How many 128-byte lines each prefetched section of one head can touch (unaligned: one more)."""
    def lines(num_bytes: int) -> int:
        return triton.next_power_of_2(-(-num_bytes // 128) + 1)

    head_bytes = layout.block_size * layout.head_dim * layout.bits // 8
    return {"CODE_LINES": lines(head_bytes), "RANGE_LINES": lines(layout.head_dim),
            "META_LINES": lines(4 * layout.block_size),
            "OUTLIER_LINES": lines(2 * max(layout.num_outliers, 1))}


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
    group = math.lcm(layout.bits, 8) // layout.bits
    groups = num_heads // layout.kv_heads
    on_grid(_kvquant_decode_kernel, (batch, layout.kv_heads, num_splits))(
        part, stats, q, packed_pool, packed_pool.view(torch.float16), tables, num_packed_blocks.contiguous(),
        tail_k, tail_v, tail_lens.contiguous(), sink_k, sink_v,
        params.key_codebook, params.key_grid_base, params.key_grid_step, params.value_codebook, params.cos, params.sin,
        scale * math.log2(math.e),
        groups, layout.num_outliers, per_split, num_splits, layout.bytes_per_block, tables.stride(0),
        q.stride(0), q.stride(1), tail_k.stride(0), tail_k.stride(1), sink_k.stride(0), sink_k.stride(1),
        layout.v_codes_offset, layout.k_low_offset, layout.k_high_offset, layout.v_center_offset,
        layout.v_scale_offset, layout.v_index_offset, layout.v_corr_offset,
        BITS=layout.bits, GROUP=group, T=layout.block_size, D=dim, M_PAD=max(16, triton.next_power_of_2(groups)),
        CHUNK=16 if layout.num_outliers <= 16 else 32, HAS_OUTLIERS=layout.num_outliers > 0,
        DOT_F32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type == "cpu"),
        PREFETCH=q.device.type == "cuda", AHEAD=_PREFETCH_AHEAD, **_prefetch_lines_meta(layout),
        num_warps=8 if layout.block_size * dim >= 8192 else 4,  # K halves, their rotation and V tiles in registers
        num_stages=1,  # the prefetch keeps blocks in flight; the pipeliner would stage the codebook gathers too
    )
    on_grid(_merge_splits_kernel, (batch, num_heads))(
        out, part, stats, num_heads, num_splits, out.stride(0), out.stride(1),
        D=dim, SPLITS_PAD=triton.next_power_of_2(num_splits),
    )
    return out
