"""Attention over the paged KV cache: storing a step's K/V into pool slots, decode and prefill attention.

Each op has a plain PyTorch reference here (`*_ref`: the kernels' oracle) and a dispatcher taking a `KernelBackend`;
the Triton kernels and their checking launchers are in `kernels.paged_attention_triton`, the C++ CPU kernels' (decode;
prefill, which the engine calls once a step for all its chunks where `prefill_takes_cpu_kernel`) in
`kernels.paged_attention_cpu`. Pool layout: see `kernels.kv_layout`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.backend import KernelBackend
from kernels.cpu_build import cpu_has_amx_bf16, cpu_has_avx512_bf16
from kernels.kv_layout import pool_dims
from kernels.paged_attention_cpu import CPU_FAST_HEAD_DIMS, paged_decode_attention_cpu, store_kv_cpu
from kernels.paged_attention_triton import (
    paged_decode_attention_triton,
    paged_prefill_attention_triton,
    store_kv_triton,
)


def store_kv_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into flat slots (block_id * block_size + offset)."""
    num_kv_heads, num_blocks, block_size, head_dim = pool_dims(k_cache)
    slots = slot_mapping.long()
    k_cache.view(num_kv_heads, num_blocks * block_size, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(num_kv_heads, num_blocks * block_size, head_dim).index_copy_(1, slots, v.transpose(0, 1))


def _gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """[num_kv_heads, len(block_ids) * block_size, head_dim]: the listed blocks of every KV head, in order."""
    num_kv_heads, num_blocks, block_size, head_dim = pool_dims(cache)
    rows = cache.view(num_kv_heads, num_blocks, block_size * head_dim)
    if out is None:
        gathered = rows.index_select(1, block_ids)
    else:
        # Into a resident buffer: a fresh multi-MB tensor per layer costs more in page faults than the copy.
        gathered = out[: num_kv_heads * block_ids.numel() * block_size * head_dim]
        gathered = torch.index_select(rows, 1, block_ids, out=gathered.view(num_kv_heads, -1, block_size * head_dim))
    return gathered.view(num_kv_heads, -1, head_dim)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query token per sequence over its whole context.

    Args:
        q: [batch, num_heads, head_dim].
        k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim].
        block_tables: [batch, max_blocks] int, padded with any valid block id.
        context_lens: [batch] int, tokens visible to each query (the query's own token included).
        workspace: optional flat buffers for the gathered K and V (each at least q-batch x max_blocks blocks of
            every KV head); without them each call allocates.
    Returns:
        [batch, num_heads, head_dim] in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = pool_dims(k_cache)
    groups = num_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    ids = block_tables.reshape(-1).long()
    k_out, v_out = workspace if workspace is not None else (None, None)
    # [num_kv_heads * batch, max_len, head_dim]: each (head, sequence) a contiguous matrix, so one bmm each.
    k = _gather_blocks(k_cache, ids, k_out).view(num_kv_heads * batch, max_len, head_dim)
    v = _gather_blocks(v_cache, ids, v_out).view(num_kv_heads * batch, max_len, head_dim)
    q_heads = q.view(batch, num_kv_heads, groups, head_dim).transpose(0, 1).reshape(-1, groups, head_dim)
    scores = torch.bmm(q_heads, k.transpose(1, 2)).view(num_kv_heads, batch, groups, max_len)
    padding = torch.arange(max_len, device=q.device)[None, :] >= context_lens[:, None]  # [batch, max_len]
    scores = scores.float().mul_(scale).masked_fill_(padding[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv_heads * batch, groups, max_len)
    out = torch.bmm(probs, v).view(num_kv_heads, batch, groups, head_dim)
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's newest tokens over its context (reused prefix + earlier chunks + these).

    Args:
        q: [num_new, num_heads, head_dim], the queries of positions context_len - num_new .. context_len - 1.
        k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim].
        block_table: [num_blocks_of_seq] int covering at least context_len tokens.
    Returns:
        [num_new, num_heads, head_dim].
    """
    block_size = k_cache.shape[2]
    table = block_table[: (context_len + block_size - 1) // block_size]
    return paged_prefill_attention_padded_ref(q, k_cache, v_cache, table[None], [q.shape[0]], [context_len], scale)


def paged_prefill_attention_padded_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_new: list[int],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """`paged_prefill_attention_ref` for several sequences in one call, each padded to the longest.

    One batched attention instead of one per sequence: worth it when the chunks have similar lengths (the caller
    decides; padding costs num_seqs x longest chunk x longest context).
    Args:
        q: [sum(num_new), num_heads, head_dim], the sequences' rows one after another.
        block_tables: [num_seqs, max_blocks] int, each row covering its context_lens entry.
        num_new, context_lens: per sequence, as in `paged_prefill_attention_ref`.
    Returns:
        [sum(num_new), num_heads, head_dim].
    """
    num_seqs, max_blocks = block_tables.shape
    num_kv_heads, _, block_size, head_dim = pool_dims(k_cache)
    max_new, max_keys = max(num_new), max_blocks * block_size
    device = q.device
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=device), torch.tensor(num_new, device=device))
    starts = torch.tensor([0, *num_new[:-1]], device=device).cumsum(0)
    row_in_seq = torch.arange(q.shape[0], device=device) - starts[seq_of_row]
    padded_q = q.new_zeros(num_seqs, max_new, q.shape[1], head_dim)
    padded_q[seq_of_row, row_in_seq] = q
    ids = block_tables.reshape(-1).long()
    # [num_seqs, kv_heads, max_keys, head_dim] views of one gather
    k = _gather_blocks(k_cache, ids, None).view(num_kv_heads, num_seqs, max_keys, head_dim).transpose(0, 1)
    v = _gather_blocks(v_cache, ids, None).view(num_kv_heads, num_seqs, max_keys, head_dim).transpose(0, 1)
    if set(num_new) == set(context_lens) == {max_new}:
        # Fresh prompts of one length: plain causal attention over the first max_new keys, no mask to build.
        k, v, mask = k[:, :, :max_new], v[:, :, :max_new], None
    else:
        context = torch.tensor(context_lens, device=device)
        first_pos = context - torch.tensor(num_new, device=device)
        query_pos = first_pos[:, None] + torch.arange(max_new, device=device)[None, :]  # [num_seqs, max_new]
        key_pos = torch.arange(max_keys, device=device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # causal; also hides keys past each context
        mask[:, :, 0] = True  # padded query rows see one key instead of none (no NaN); they are dropped below
        mask = mask[:, None]
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2), k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )  # [num_seqs, num_heads, max_new, head_dim]
    return out.transpose(1, 2)[seq_of_row, row_in_seq]


def fresh_prefill_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, scale: float
) -> torch.Tensor:
    """Causal attention of `num_seqs` whole prompts of one length over their own k, v, as the step computed them.

    For prompts with nothing cached before them the pool holds exactly these k, v (stored this step), so reading them
    back (the gather of `paged_prefill_attention_padded_ref`) and padding the queries is work for nothing.
    Args:
        q: [num_seqs * length, num_heads, head_dim], the prompts one after another; k, v: [same, num_kv_heads,
            head_dim]. Views with strided rows (slices of the fused projection) are taken as they are.
    Returns:
        [num_seqs * length, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape

    def per_seq(x: torch.Tensor) -> torch.Tensor:  # [num_seqs, heads, length, head_dim]
        return x.unflatten(0, (num_seqs, num_tokens // num_seqs)).transpose(1, 2)

    out = F.scaled_dot_product_attention(per_seq(q), per_seq(k), per_seq(v), is_causal=True, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)


# ---- Dispatchers: what the engine calls --------------------------------------------------------------------


_STORE_KV = {KernelBackend.TORCH: store_kv_ref, KernelBackend.TRITON: store_kv_triton, KernelBackend.CPU: store_kv_cpu}


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor, backend: KernelBackend,
) -> None:
    """`store_kv_ref`, `store_kv_triton` or `store_kv_cpu`, by backend."""
    _STORE_KV[backend](k_cache, v_cache, k, v, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, backend: KernelBackend,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`paged_decode_attention_ref` (which may gather into `workspace`) or its Triton or C++ kernel, by backend
    (the C++ one at the head sizes it has a fast path for; the reference is faster at the others).

    Returns [batch, num_heads, head_dim].
    """
    if backend is KernelBackend.TRITON:
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    if decode_takes_reference(backend, q.shape[-1]):
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, workspace)
    return paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale)


def decode_takes_reference(backend: KernelBackend, head_dim: int) -> bool:
    """Whether `paged_decode_attention` runs the reference (which gathers, into a workspace when given one): on the
    torch backend, and on the CPU backend at head sizes its kernel has no fast path for."""
    if backend is KernelBackend.CPU:
        return head_dim not in CPU_FAST_HEAD_DIMS
    return backend is KernelBackend.TORCH


def prefill_takes_cpu_kernel(backend: KernelBackend, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a step's prefill attention runs `paged_prefill_attention_cpu` (all its chunks in one call) rather than
    the references: on the CPU backend in bf16 at head sizes 64 and 128, where the CPU has AVX512-BF16 dot products
    (PyTorch's SDPA on CPU reaches about a sixth of the matmuls' rate there) but no AMX. With AMX, SDPA's flash
    attention runs on AMX tiles and beats the kernel's dot products: on a 2-core Xeon with AMX, 8 chunks of 256 new
    tokens after 0 / 256 / 1,024 cached, the kernel took 2.4x / 2.1x / 2.4x the references' time
    (`benchmarks/cpu_prefill_attention.py op`)."""
    return (backend is KernelBackend.CPU and dtype == torch.bfloat16 and head_dim in CPU_FAST_HEAD_DIMS
            and cpu_has_avx512_bf16() and not cpu_has_amx_bf16())


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    context_len: int, scale: float, backend: KernelBackend,
) -> torch.Tensor:
    """`paged_prefill_attention_ref` or its Triton kernel, by backend; returns [num_new, heads, head_dim]."""
    is_triton = backend is KernelBackend.TRITON
    attend = paged_prefill_attention_triton if is_triton else paged_prefill_attention_ref
    return attend(q, k_cache, v_cache, block_table, context_len, scale)
