"""The C++ CPU decode attention (`kernels/csrc/paged_decode_attention.cpp`): its launcher, and the head sizes it has
a fast path for.

It reads K and V straight from the paged pool: what `paged_decode_attention_ref` gathers into a workspace first. The
kernel checks its arguments itself (shapes, dtypes, and every length and block id against the pool); its refusals
come out as ValueError, as the Triton launchers' do.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import cpu_kernels_error

# Head sizes with an AVX-512 path in the kernel; at others it runs portable loops that measured slower than the
# reference (head size 24, batch 32, one thread: 2.8 against 0.6 ms), so the dispatcher keeps the reference there.
CPU_FAST_HEAD_DIMS = (64, 128)


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


def fresh_prefill_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, scale: float
) -> torch.Tensor:
    """`fresh_prefill_attention_ref`'s arguments and result, bf16 at head sizes 64 and 128 on AVX512-BF16 CPUs.

    Raises:
        ValueError: another dtype or head size, mismatched shapes, or tokens that are not `num_seqs` equal prompts.
        RuntimeError: the kernels did not build, or were built for a CPU without AVX512-BF16.
    """
    error = cpu_kernels_error()
    if error is not None:
        raise RuntimeError(error)
    q, k, v = (x if x.dim() != 3 or (x.stride(2) == 1 and x.stride(1) == x.shape[2]) else x.contiguous()
               for x in (q, k, v))
    try:
        return torch.ops.tsukimi_cpu.prefill_attention(q, k, v, int(num_seqs), float(scale))
    except RuntimeError as exc:
        message = str(exc).splitlines()[0]
        if "without AVX512-BF16" in message:
            raise
        raise ValueError(message) from None
