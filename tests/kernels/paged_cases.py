"""What the paged-attention tests share: tolerances per dtype, seeded generators, a random paged pool with its block
tables and queries, and the dense per-token oracle."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TOLERANCES = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # atol = rtol, per dtype
DTYPES = pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and actual.shape == expected.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def seeded(seed: int, device: torch.device = DEVICE) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class Pool:
    block_size: int
    num_kv_heads: int
    groups: int
    head_dim: int
    num_blocks: int = 40

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.groups

    def caches(self, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Random K and V pools: a kernel reading a wrong block or slot reads wrong values."""
        shape = (self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)
        k = torch.randn(shape, generator=gen, device=gen.device).to(dtype)
        return k, torch.randn(shape, generator=gen, device=gen.device).to(dtype)

    def queries(self, num_rows: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
        """[num_rows, num_heads, head_dim], a strided view as the model's projections produce."""
        wide = torch.randn(num_rows, self.num_heads + 2, self.head_dim, generator=gen, device=gen.device)
        return wide.to(dtype)[:, 1:-1]

    def tables(self, batch: int, max_blocks: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
        """[batch, max_blocks] distinct, shuffled, non-contiguous block ids."""
        ids = torch.randperm(self.num_blocks, generator=gen, device=gen.device)[: batch * max_blocks]
        return ids.view(batch, max_blocks).to(dtype)


def dense_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    context_len: int, scale: float,
) -> torch.Tensor:
    """float64 causal softmax(QK^T)V for one sequence's last q.shape[0] positions, keys gathered one by one"""
    num_kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    groups = q.shape[1] // num_kv_heads
    slots = [(int(block_table[pos // block_size]), pos % block_size) for pos in range(context_len)]
    k = torch.stack([k_cache[:, b, o] for b, o in slots]).double().repeat_interleave(groups, dim=1)
    v = torch.stack([v_cache[:, b, o] for b, o in slots]).double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,chd->htc", q.double(), k) * scale  # [num_heads, num_rows, context_len]
    query_pos = torch.arange(context_len - q.shape[0], context_len)
    visible = torch.arange(context_len)[None, :] <= query_pos[:, None]  # [num_rows, context_len]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("htc,chd->thd", probs, v)
