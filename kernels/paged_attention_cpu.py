"""The C++ CPU decode attention (`kernels/csrc/paged_decode_attention.cpp`), checked like the Triton launchers.

It reads K and V straight from the paged pool: what `paged_decode_attention_ref` gathers into a workspace first.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import cpu_kernels_error

# Head sizes with an AVX-512 path in the kernel; at others it runs portable loops that measured slower than the
# reference (head size 24, batch 32: 2.8 against 0.6 ms), so the dispatcher keeps the reference there.
CPU_FAST_HEAD_DIMS = (64, 128)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


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
    _require(q.device.type == k_cache.device.type == v_cache.device.type == "cpu", "the C++ kernel runs on CPU")
    _require(q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
             f"q {tuple(q.shape)} and pools {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit")
    _require(q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    _require(q.shape[1] % k_cache.shape[0] == 0 and q.shape[2] == k_cache.shape[3],
             f"{q.shape[1]} heads of {q.shape[2]} do not fit {k_cache.shape[0]} KV heads of {k_cache.shape[3]}")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), "the pools must be contiguous")
    batch = q.shape[0]
    _require(block_tables.dim() == 2 and block_tables.shape[0] == batch,
             f"block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}")
    _require(context_lens.shape == (batch,), f"context_lens shape {tuple(context_lens.shape)} != ({batch},)")
    if batch == 0:
        return torch.empty_like(q)
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    try:
        return torch.ops.tsukimi_cpu.paged_decode_attention(
            q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
            context_lens.to(torch.int32).contiguous(), float(scale),
        )
    except RuntimeError as exc:  # the kernel's own checks (lengths, block ids)
        raise ValueError(str(exc).splitlines()[0]) from None
