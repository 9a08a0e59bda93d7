"""The C++ CPU prefill kernel (`paged_prefill_attention_cpu`: every chunk of a step, straight from the pool) against
the references and the dense oracle; what it must never read; its refusals; where the engine takes it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import paged_attention
from kernels.backend import KernelBackend
from kernels.cpu_build import cpu_has_avx512_bf16
from kernels.paged_attention import (
    fresh_prefill_attention_ref,
    paged_prefill_attention_ref,
    prefill_takes_cpu_kernel,
    store_kv_ref,
)
from kernels.paged_attention_cpu import paged_prefill_attention_cpu
from tests.kernels.paged_cases import Pool, dense_attention, seeded

BF16_DOTS = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the kernel is written in AVX512-BF16 dot products")


@dataclass(frozen=True)
class PrefillStep:
    """A step's prefill chunks over a random bf16 pool: chunk s is the last num_new[s] of context_lens[s] tokens."""

    pool: Pool
    num_new: list[int]
    context_lens: list[int]

    def make(self, seed: int) -> tuple[torch.Tensor, ...]:
        gen, pool = seeded(seed, torch.device("cpu")), self.pool
        k_cache, v_cache = pool.caches(torch.bfloat16, gen)
        width = max(-(-n // pool.block_size) for n in self.context_lens)
        tables = pool.tables(len(self.num_new), width, torch.int32, gen)
        q = pool.queries(sum(self.num_new), torch.bfloat16, gen)
        starts = torch.tensor([0, *self.num_new]).cumsum(0).int()
        return q, k_cache, v_cache, tables, torch.tensor(self.context_lens).int(), starts

    def reference(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  starts: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.cat([
            paged_prefill_attention_ref(q[starts[s] : starts[s + 1]].contiguous(), k_cache, v_cache, tables[s].long(),
                                        context_len, scale)
            for s, context_len in enumerate(self.context_lens)
        ])


PREFILL_STEPS = {
    "smollm2-fresh-prompts": PrefillStep(Pool(16, 3, 3, 64, num_blocks=96), [96] * 8, [96] * 8),
    "after-cached-prefixes": PrefillStep(Pool(16, 3, 3, 64, num_blocks=96), [37, 1, 64, 5], [37, 80, 200, 21]),
    "odd-blocks": PrefillStep(Pool(5, 2, 4, 64, num_blocks=96), [33, 17], [33, 61]),
    "llama3-heads": PrefillStep(Pool(16, 2, 4, 128, num_blocks=96), [70, 40], [70, 300]),
    "group-of-8": PrefillStep(Pool(16, 1, 8, 64, num_blocks=64), [100], [130]),
    "group-of-5": PrefillStep(Pool(16, 2, 5, 64, num_blocks=64), [41], [41]),
    "no-gqa": PrefillStep(Pool(16, 4, 1, 128, num_blocks=64), [65, 3], [65, 90]),
    "one-token": PrefillStep(Pool(16, 3, 3, 64, num_blocks=8), [1], [1]),
}


@BF16_DOTS
@pytest.mark.parametrize("step", PREFILL_STEPS.values(), ids=PREFILL_STEPS.keys())
def test_cpu_prefill_kernel_matches_the_reference(step: PrefillStep) -> None:
    q, k_cache, v_cache, tables, lens, starts = step.make(seed=21)
    scale = step.pool.head_dim**-0.5
    out = paged_prefill_attention_cpu(q, k_cache, v_cache, tables, lens, starts, scale)
    expected = step.reference(q, k_cache, v_cache, tables, starts, scale)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@BF16_DOTS
def test_cpu_prefill_kernel_equals_the_fresh_prompts_shortcut() -> None:
    """Prompts with nothing cached: the kernel reading the pool equals the reference over the step's own k, v."""
    pool, num_seqs, length = Pool(16, 3, 3, 64, num_blocks=64), 3, 50
    gen = seeded(25, torch.device("cpu"))
    k_cache, v_cache = pool.caches(torch.bfloat16, gen)
    tables = pool.tables(num_seqs, 4, torch.int64, gen)
    fused = torch.randn(num_seqs * length, pool.num_heads + 2 * pool.num_kv_heads, 64, generator=gen).bfloat16()
    q, k, v = fused.split([pool.num_heads, pool.num_kv_heads, pool.num_kv_heads], dim=1)
    slots = torch.cat([tables[s, torch.arange(length) // 16] * 16 + torch.arange(length) % 16 for s in range(3)])
    store_kv_ref(k_cache, v_cache, k, v, slots)
    starts = torch.arange(num_seqs + 1) * length
    out = paged_prefill_attention_cpu(q, k_cache, v_cache, tables, torch.full((num_seqs,), length), starts, 0.125)
    expected = fresh_prefill_attention_ref(q, k, v, num_seqs, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@BF16_DOTS
def test_cpu_prefill_kernel_sees_no_later_token_and_nothing_past_the_context() -> None:
    """Non-finite K/V at a chunk's token reach no query before it, nor another chunk; rows past a context's end in its
    last block (stale or never written) change nothing (an odd row count's pad key is zeroed, not weighted zero)."""
    step = PrefillStep(Pool(16, 3, 3, 64, num_blocks=32), [21, 9, 12], [21, 41, 12])
    q, k_cache, v_cache, tables, lens, starts = step.make(seed=22)
    for s, context_len in enumerate(step.context_lens):  # the stale tail of each last block
        last, used = int(tables[s, (context_len - 1) // 16]), (context_len - 1) % 16 + 1
        k_cache[:, last, used:], v_cache[:, last, used:] = float("nan"), float("inf")
    clean = paged_prefill_attention_cpu(q, k_cache, v_cache, tables, lens, starts, 0.125)
    for s, context_len in enumerate(step.context_lens):  # the dense oracle reads no row past the context
        rows = slice(int(starts[s]), int(starts[s + 1]))
        dense = dense_attention(q[rows], k_cache, v_cache, tables[s], context_len, 0.125)
        torch.testing.assert_close(clean[rows].float(), dense.float(), atol=2e-2, rtol=2e-2)
    position = 41 - 9 + 4  # the second chunk's fifth new token
    block, offset = int(tables[1, position // 16]), position % 16
    k_cache[:, block, offset], v_cache[:, block, offset] = float("nan"), float("inf")
    out = paged_prefill_attention_cpu(q, k_cache, v_cache, tables, lens, starts, 0.125)
    poisoned_row = 21 + 4
    assert torch.equal(out[:poisoned_row], clean[:poisoned_row])
    assert torch.equal(out[30:], clean[30:])  # the third chunk
    assert not torch.isfinite(out[poisoned_row:30].float()).all()


@BF16_DOTS
def test_the_cpu_prefill_kernel_is_taken_only_where_it_has_a_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_attention, "cpu_has_amx_bf16", lambda: False)
    assert prefill_takes_cpu_kernel(KernelBackend.CPU, torch.bfloat16, 64)
    assert prefill_takes_cpu_kernel(KernelBackend.CPU, torch.bfloat16, 128)
    assert not prefill_takes_cpu_kernel(KernelBackend.TORCH, torch.bfloat16, 64)
    assert not prefill_takes_cpu_kernel(KernelBackend.CPU, torch.float32, 64)
    assert not prefill_takes_cpu_kernel(KernelBackend.CPU, torch.bfloat16, 24)


def test_with_amx_the_prefill_attention_stays_with_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_attention, "cpu_has_avx512_bf16", lambda: True)
    monkeypatch.setattr(paged_attention, "cpu_has_amx_bf16", lambda: True)
    assert not prefill_takes_cpu_kernel(KernelBackend.CPU, torch.bfloat16, 64)


@BF16_DOTS
@pytest.mark.parametrize(
    "change, match",
    [("fp32", "bf16 only"), ("head-24", "head size 64 or 128"), ("context-shorter", "new tokens of a context"),
     ("past-the-table", "new tokens of a context"), ("block-past-the-pool", "not a block"),
     ("negative-block", "not a block"), ("starts", "query starts must run")],
)
def test_cpu_prefill_kernel_refuses_what_would_read_outside_q_or_the_pool(change: str, match: str) -> None:
    pool = Pool(4, 2, 2, 24 if change == "head-24" else 64, num_blocks=16)
    q, k_cache, v_cache, tables, lens, starts = PrefillStep(pool, [3, 5], [6, 5]).make(seed=24)
    if change == "fp32":
        q = q.float()
    elif change == "context-shorter":
        lens[1] = 4
    elif change == "past-the-table":
        lens[0] = 9
    elif change in ("block-past-the-pool", "negative-block"):
        tables[0, 1] = 16 if change == "block-past-the-pool" else -1
    elif change == "starts":
        starts[-1] = 9
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention_cpu(q, k_cache, v_cache, tables, lens, starts, 0.125)
