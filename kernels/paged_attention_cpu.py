"""The C++ CPU attention kernels' launchers: decode (`kernels/csrc/paged_decode_attention.cpp`), prefill
(`kernels/csrc/prefill_attention.cpp`) and the store of a step's new K and V (`kernels/csrc/store_kv.cpp`), and the
head sizes the attention kernels have fast paths for.

Both read K and V straight from the paged pool: what `paged_decode_attention_ref` and `paged_prefill_attention_ref`
gather first. The kernels check their arguments themselves (shapes, dtypes, and every length and block id against
the pool); their refusals come out as ValueError, as the Triton launchers' do.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import cpu_kernels_error

# Head sizes with an AVX-512 path in the kernel; at others it runs portable loops that measured slower than the
# reference (head size 24, batch 32, one thread: 2.8 against 0.6 ms), so the dispatcher keeps the reference there.
CPU_FAST_HEAD_DIMS = (64, 128)


def store_kv_cpu(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`store_kv_ref` in one call: k, v [num_tokens, num_kv_heads, head_dim] (any token and head strides, each head's
    row contiguous) into the flat slots of slot_mapping.

    Raises:
        ValueError: mismatched shapes or dtypes, or a slot outside the pool.
        RuntimeError: the kernels did not build (see `kernels.cpu_build`).
    """
    error = cpu_kernels_error()
    if error is not None:
        raise RuntimeError(error)
    k, v = (x if x.dim() != 3 or x.stride(2) == 1 else x.contiguous() for x in (k, v))
    try:
        torch.ops.tsukimi_cpu.store_kv(k_cache, v_cache, k, v, slot_mapping.to(torch.int64).contiguous())
    except RuntimeError as exc:
        raise ValueError(str(exc).splitlines()[0]) from None


def paged_decode_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """`paged_decode_attention_ref`'s arguments and result; every context_len must be >= 1.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, or a length or block id outside the pool.
        RuntimeError: the kernels did not build (see `kernels.cpu_build`).
    """
    error = cpu_kernels_error()
    if error is not None:
        raise RuntimeError(error)
    if q.dim() == 3 and (q.stride(2) != 1 or q.stride(1) != q.shape[2]):
        q = q.contiguous()  # the kernel takes any row stride, but each row's heads side by side
    try:
        return torch.ops.tsukimi_cpu.paged_decode_attention(
            q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous(),
            float(scale),
        )
    except RuntimeError as exc:  # the kernel's checks (TORCH_CHECK), or a tensor on another device
        raise ValueError(str(exc).splitlines()[0]) from None


def paged_prefill_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, query_starts: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Every prefill chunk of a step in one call, bf16, head sizes 64 and 128, on CPUs with AVX512-BF16.

    Chunk s is q's rows [query_starts[s], query_starts[s + 1]): the last new tokens of a context of context_lens[s]
    tokens in the blocks block_tables[s] (its own K/V stored), attending causally: `paged_prefill_attention_ref` for
    each chunk, concatenated.
    Args:
        q: [num_tokens, num_heads, head_dim]; block_tables: [num_chunks, max_blocks]; context_lens: [num_chunks];
            query_starts: [num_chunks + 1], from 0 to num_tokens.
    Raises:
        ValueError: another dtype or head size, mismatched shapes, or a length, start or block id outside q or the
            pool.
        RuntimeError: the kernels did not build, or were built for a CPU without AVX512-BF16.
    """
    error = cpu_kernels_error()
    if error is not None:
        raise RuntimeError(error)
    if q.dim() == 3 and (q.stride(2) != 1 or q.stride(1) != q.shape[2]):
        q = q.contiguous()
    try:
        return torch.ops.tsukimi_cpu.paged_prefill_attention(
            q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous(),
            query_starts.to(torch.int32).contiguous(), float(scale),
        )
    except RuntimeError as exc:
        message = str(exc).splitlines()[0]
        if "without AVX512-BF16" in message:
            raise
        raise ValueError(message) from None
