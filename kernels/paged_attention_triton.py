"""Triton kernels for the paged KV cache (store K/V, decode attention, prefill attention) and their launchers,
which check shapes, dtypes and devices. The references they must match are in `kernels.paged_attention`.
Triton is imported on the first launch, never on CPU deployments.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.backend import jit_into, on_grid
from kernels.kv_layout import pool_dims

# Bound by _load_triton on the first Triton launch: CPU deployments never need triton, and its interpreter
# switch (TRITON_INTERPRET) must be set before triton is first imported, which the kernel tests do.
triton: Any = None
tl: Any = None


# ---- Triton kernels, jitted by _load_triton ----------------------------------------------------------------


def _store_kv_kernel(
    k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slot_ptr,
    block_size, num_kv_heads, head_dim,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_kt, stride_kh, stride_kd,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    # One program per token: copy its [num_kv_heads, head_dim] K and V rows into the pool slot.
    token = tl.program_id(0)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst = dst + heads * stride_ch + dims * stride_cd
    src = token * stride_kt + heads * stride_kh + dims * stride_kd
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


def _dot(a, b, UPCAST: tl.constexpr):
    # The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584); exact products of
    # bf16 values accumulated in fp32 are what the GPU's bf16 MMA computes anyway. fp32 stays fp32 (not tf32).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


def _attend(
    q, k_cache_ptr, v_cache_ptr, table_ptr, head_offset, key_end, row_pos, scale,
    block_size, head_dim, stride_cb, stride_cs, stride_cd,
    BLOCK_N: tl.constexpr, DIM_PAD: tl.constexpr, UPCAST: tl.constexpr,
):
    # q [M, DIM_PAD] over keys [0, key_end) of one KV head, key j visible to row i iff j <= row_pos[i].
    # Online softmax in fp32; returns the normalized [M, DIM_PAD] output in fp32.
    dims = tl.arange(0, DIM_PAD)
    m_i = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros([q.shape[0], DIM_PAD], tl.float32)
    for start in range(0, key_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions, possibly spanning several blocks
        in_ctx = pos < key_end
        block_ids = tl.load(table_ptr + pos // block_size, mask=in_ctx, other=0).to(tl.int64)
        rows = block_ids * stride_cb + (pos % block_size) * stride_cs + head_offset
        kv_offsets = rows[:, None] + dims[None, :] * stride_cd  # [BLOCK_N, DIM_PAD]
        kv_mask = in_ctx[:, None] & (dims < head_dim)[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = _dot(q, tl.trans(k), UPCAST) * scale  # [M, BLOCK_N]
        scores = tl.where(pos[None, :] <= row_pos[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    return acc / l_i[:, None]


def _paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, scale,
    block_size, max_blocks, groups, head_dim,
    stride_qb, stride_qh, stride_qd, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_tb,
    GROUPS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DIM_PAD: tl.constexpr, UPCAST: tl.constexpr,
):
    # One program per (sequence, KV head); its rows are the `groups` query heads sharing that KV head.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = kv_head * groups + tl.arange(0, GROUPS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads < (kv_head + 1) * groups)[:, None] & (dims < head_dim)[None, :]
    q_offsets = seq * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offsets, mask=mask, other=0.0)
    # Positions past the block table do not exist, as in the reference.
    context_len = tl.minimum(tl.load(context_lens_ptr + seq), max_blocks * block_size)
    row_pos = tl.zeros([GROUPS_PAD], tl.int32) + context_len - 1
    out = _attend(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_tb, kv_head * stride_ch, context_len,
        row_pos, scale, block_size, head_dim, stride_cb, stride_cs, stride_cd, BLOCK_N, DIM_PAD, UPCAST,
    )
    out_offsets = seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def _paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, scale,
    num_new, context_len, block_size, groups, head_dim,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_cd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIM_PAD: tl.constexpr, UPCAST: tl.constexpr,
):
    # One program per (tile of BLOCK_M new tokens, query head); keys past the tile's last position are skipped
    tile = tl.program_id(0)
    head = tl.program_id(1)
    tokens = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_PAD)
    mask = (tokens < num_new)[:, None] & (dims < head_dim)[None, :]
    q_offsets = tokens[:, None] * stride_qt + head * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offsets, mask=mask, other=0.0)
    first_pos = context_len - num_new
    key_end = tl.minimum(context_len, first_pos + (tile + 1) * BLOCK_M)
    out = _attend(
        q, k_cache_ptr, v_cache_ptr, block_table_ptr, (head // groups) * stride_ch, key_end,
        first_pos + tokens, scale, block_size, head_dim, stride_cb, stride_cs, stride_cd,
        BLOCK_N, DIM_PAD, UPCAST,
    )
    out_offsets = tokens[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


_KERNELS = (_store_kv_kernel, _dot, _attend, _paged_decode_kernel, _paged_prefill_kernel)


def _load_triton() -> None:
    """Import triton and jit the kernels above; RuntimeError if triton is not installed."""
    global triton
    triton = jit_into(globals(), _KERNELS)


# ---- Launchers: check arguments, pick tile sizes, launch ---------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_HEAD_DIM = 256


def _require(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise ValueError(message)


def _check_common(
    q_or_k: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *indices: torch.Tensor
) -> None:
    """Checks shared by every launcher: Triton present, pool layout, dtypes, one device."""
    if triton is None:
        _load_triton()
    _require(k_cache.dim() == 4, f"k_cache must be [num_kv_heads, num_blocks, block_size, head_dim], got "
             f"{tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(),
             f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)} in shape and strides")
    _require(k_cache.dtype in _FLOAT_DTYPES and v_cache.dtype == k_cache.dtype == q_or_k.dtype,
             f"dtypes must agree and be fp32/fp16/bf16, got {q_or_k.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    _require(k_cache.shape[3] <= _MAX_HEAD_DIM, f"head_dim {k_cache.shape[3]} exceeds {_MAX_HEAD_DIM}")
    for index in indices:
        _require(index.dtype in _INDEX_DTYPES,
                 f"block tables, lengths and slots must be int32/int64, got {index.dtype}")
    devices = {t.device for t in (q_or_k, k_cache, v_cache, *indices)}
    _require(len(devices) == 1, f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")


def _pool_strides(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Strides in the kernels' argument order: (block, slot in block, KV head, dim)."""
    stride_head, stride_block, stride_slot, stride_dim = cache.stride()
    return stride_block, stride_slot, stride_head, stride_dim


def _attend_meta(q: torch.Tensor) -> dict[str, Any]:
    """Tile sizes, and whether to upcast bf16 dot operands (the CPU interpreter cannot multiply bf16)."""
    dim_pad = max(16, triton.next_power_of_2(q.shape[2]))  # tl.dot wants K >= 16; MMA tiles are 16 rows
    block_n = 64 if dim_pad <= 128 else 32  # keeps a K and a V tile in registers at head_dim 256
    is_interpreted_bf16 = q.dtype == torch.bfloat16 and q.device.type == "cpu"
    return {"BLOCK_N": block_n, "DIM_PAD": dim_pad, "UPCAST": is_interpreted_bf16}


def store_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton `store_kv_ref`: write k, v [num_tokens, num_kv_heads, head_dim] into the pool at slot_mapping.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices. Slots must lie inside the pool (not checked: it
            would cost a device sync).
    """
    _check_common(k, k_cache, v_cache, slot_mapping)
    num_kv_heads, _, block_size, head_dim = pool_dims(k_cache)
    _require(k.dim() == 3 and k.shape[1:] == (num_kv_heads, head_dim),
             f"k must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(k.shape)}")
    _require(v.shape == k.shape and v.dtype == k.dtype and v.device == k.device, "v must match k")
    _require(slot_mapping.shape == (k.shape[0],), f"slot_mapping must be [{k.shape[0]}], got "
             f"{tuple(slot_mapping.shape)}")
    k, v = (k, v) if v.stride() == k.stride() else (k.contiguous(), v.contiguous())
    slot_mapping = slot_mapping.contiguous()  # the kernel reads slot i at offset i
    if k.shape[0] == 0:
        return
    on_grid(_store_kv_kernel, (k.shape[0],))(
        k_cache, v_cache, k, v, slot_mapping, block_size, num_kv_heads, head_dim,
        *_pool_strides(k_cache), *k.stride(),
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )


def _check_query(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Check q [rows, num_heads, head_dim] against the pool; returns the GQA group size."""
    _require(q.dim() == 3, f"q must be [rows, num_heads, head_dim], got {tuple(q.shape)}")
    num_kv_heads, _, _, head_dim = pool_dims(k_cache)
    _require(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    _require(q.shape[1] % num_kv_heads == 0, f"num_heads {q.shape[1]} is not a multiple of num_kv_heads "
             f"{num_kv_heads}")
    return q.shape[1] // num_kv_heads


def paged_decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Triton `paged_decode_attention_ref`: same arguments and result; every context_len must be >= 1.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices.
    """
    _check_common(q, k_cache, v_cache, block_tables, context_lens)
    groups = _check_query(q, k_cache)
    batch = q.shape[0]
    _require(block_tables.dim() == 2 and block_tables.shape[0] == batch,
             f"block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}")
    _require(context_lens.shape == (batch,), f"context_lens shape {tuple(context_lens.shape)} != ({batch},)")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    context_lens = context_lens.contiguous()
    num_kv_heads, _, block_size, _ = pool_dims(k_cache)
    on_grid(_paged_decode_kernel, (batch, num_kv_heads))(
        out, q, k_cache, v_cache, block_tables, context_lens, scale,
        block_size, block_tables.shape[1], groups, q.shape[2],
        *q.stride(), out.stride(0), out.stride(1), *_pool_strides(k_cache), block_tables.stride(0),
        GROUPS_PAD=max(16, triton.next_power_of_2(groups)), **_attend_meta(q),
    )
    return out


def paged_prefill_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    context_len: int, scale: float,
) -> torch.Tensor:
    """Triton `paged_prefill_attention_ref` (same arguments and result).

    Raises:
        ValueError: on mismatched shapes, dtypes or devices, more new tokens than context_len, or a block
            table too short for context_len.
    """
    _check_common(q, k_cache, v_cache, block_table)
    groups = _check_query(q, k_cache)
    num_new, block_size = q.shape[0], pool_dims(k_cache)[2]
    _require(0 < num_new <= context_len, f"need 0 < num_new ({num_new}) <= context_len ({context_len})")
    num_blocks = -(-context_len // block_size)
    _require(block_table.dim() == 1 and block_table.shape[0] >= num_blocks,
             f"block_table must be 1-D with >= {num_blocks} blocks, got {tuple(block_table.shape)}")
    block_table = block_table if block_table.stride(0) == 1 else block_table.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m = 16 if num_new <= 16 else 64
    on_grid(_paged_prefill_kernel, (triton.cdiv(num_new, block_m), q.shape[1]))(
        out, q, k_cache, v_cache, block_table, scale, num_new, context_len, block_size, groups, q.shape[2],
        *q.stride(), out.stride(0), out.stride(1), *_pool_strides(k_cache),
        BLOCK_M=block_m, **_attend_meta(q),
    )
    return out
