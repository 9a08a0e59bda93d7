"""Paged attention: references against a dense per-token oracle; Triton kernels against the references
(interpreted on CPU at small odd shapes, see conftest.py; on CUDA also at real shapes); the C++ CPU decode kernel
against both; argument checks and the backend switch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kernels.backend import KernelBackend, select_backend, triton_available
from kernels.cpu_build import cpu_has_avx512, cpu_has_avx512_bf16, cpu_kernels_error
from kernels.paged_attention import (
    fresh_prefill_attention_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_padded_ref,
    paged_prefill_attention_ref,
    prefill_takes_cpu_kernel,
    store_kv,
    store_kv_ref,
)
from kernels.paged_attention_cpu import paged_decode_attention_cpu, paged_prefill_attention_cpu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # atol = rtol, per dtype
DTYPES = pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="real shapes are too slow for the interpreter")
TRITON = KernelBackend.TRITON


def triton_test(test: Callable[..., None]) -> Callable[..., None]:
    """Fail with the reason when triton is missing (it is a test extra) or its interpreter cannot run."""
    return pytest.mark.usefixtures("triton_ready")(test)


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


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and actual.shape == expected.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# ---- the references against the dense oracle (CPU) ------------------------------------------------------


def test_decode_ref_matches_dense_attention() -> None:
    gen, pool = seeded(1, torch.device("cpu")), Pool(block_size=4, num_kv_heads=3, groups=2, head_dim=16)
    context_lens = torch.tensor([1, 5, 17, 8])
    k_cache, v_cache = pool.caches(torch.float32, gen)
    q, tables = pool.queries(4, torch.float32, gen), pool.tables(4, 6, torch.int64, gen)
    out = paged_decode_attention_ref(q.contiguous(), k_cache, v_cache, tables, context_lens, 0.3)
    for b, context_len in enumerate(context_lens.tolist()):
        expected = dense_attention(q[b : b + 1], k_cache, v_cache, tables[b], context_len, 0.3)
        torch.testing.assert_close(out[b : b + 1], expected.float(), atol=1e-5, rtol=1e-5)


def test_decode_ref_gathers_into_a_workspace_with_the_same_result() -> None:
    gen, pool = seeded(5, torch.device("cpu")), Pool(block_size=4, num_kv_heads=3, groups=2, head_dim=16)
    k_cache, v_cache = pool.caches(torch.float32, gen)
    q, tables = pool.queries(3, torch.float32, gen).contiguous(), pool.tables(3, 4, torch.int64, gen)
    lens = torch.tensor([16, 3, 9])
    workspace = (torch.full((4096,), float("nan")), torch.full((4096,), float("nan")))
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)
    assert torch.equal(paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3, workspace), expected)


@pytest.mark.parametrize("num_new, context_len", [(9, 9), (4, 13), (1, 6)], ids=["whole", "chunk", "one"])
def test_prefill_ref_matches_dense_attention(num_new: int, context_len: int) -> None:
    gen, pool = seeded(2, torch.device("cpu")), Pool(block_size=4, num_kv_heads=1, groups=3, head_dim=16)
    k_cache, v_cache = pool.caches(torch.float32, gen)
    q, table = pool.queries(num_new, torch.float32, gen), pool.tables(1, 5, torch.int64, gen)[0]
    out = paged_prefill_attention_ref(q, k_cache, v_cache, table, context_len, 0.25)
    expected = dense_attention(q, k_cache, v_cache, table, context_len, 0.25)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "num_new, context_lens",
    [([5, 1, 9, 3], [5, 11, 13, 16]), ([6, 6, 6], [6, 6, 6])],
    ids=["mixed", "fresh-alike"],  # fresh prompt, decode-like, chunks after a prefix; or the unmasked fast case
)
def test_padded_prefill_ref_equals_one_call_per_sequence(num_new: list[int], context_lens: list[int]) -> None:
    gen, pool = seeded(6, torch.device("cpu")), Pool(block_size=4, num_kv_heads=3, groups=3, head_dim=16)
    k_cache, v_cache = pool.caches(torch.float32, gen)
    tables = pool.tables(len(num_new), 4, torch.int64, gen)
    q = pool.queries(sum(num_new), torch.float32, gen).contiguous()
    out = paged_prefill_attention_padded_ref(q, k_cache, v_cache, tables, num_new, context_lens, 0.3)
    start = 0
    for row, (new, context_len) in enumerate(zip(num_new, context_lens, strict=True)):
        rows = q[start : start + new]
        expected = paged_prefill_attention_ref(rows, k_cache, v_cache, tables[row], context_len, 0.3)
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-5, rtol=1e-5)
        start += new


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_fresh_prompts_attend_over_their_own_kv_as_over_the_pool(num_seqs: int) -> None:
    """Whole prompts with nothing cached: attention over the step's own k, v (strided views of one projection, as
    the model's) equals attention over what the pool holds after they are stored."""
    gen, pool = seeded(8, torch.device("cpu")), Pool(block_size=4, num_kv_heads=3, groups=3, head_dim=16)
    k_cache, v_cache = pool.caches(torch.float32, gen)
    length = 10
    tables = pool.tables(num_seqs, 3, torch.int64, gen)
    fused = torch.randn(num_seqs * length, pool.num_heads + 2 * pool.num_kv_heads, pool.head_dim, generator=gen)
    q, k, v = fused.split([pool.num_heads, pool.num_kv_heads, pool.num_kv_heads], dim=1)
    slots = torch.cat([tables[s, torch.arange(length) // 4] * 4 + torch.arange(length) % 4 for s in range(num_seqs)])
    store_kv_ref(k_cache, v_cache, k, v, slots)
    out = fresh_prefill_attention_ref(q, k, v, num_seqs, 0.3)
    expected = paged_prefill_attention_padded_ref(q.contiguous(), k_cache, v_cache, tables, [length] * num_seqs,
                                                  [length] * num_seqs, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_store_kv_ref_writes_each_token_to_its_slot() -> None:
    gen, pool = seeded(3, torch.device("cpu")), Pool(4, 3, 1, 8, num_blocks=5)
    k_cache, v_cache = pool.caches(torch.float32, gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([7, 0, 19, 12])
    k, v = torch.randn(4, 3, 8, generator=gen), torch.randn(4, 3, 8, generator=gen)
    store_kv_ref(k_cache, v_cache, k, v, slots)
    for token, slot in enumerate(slots.tolist()):
        expected_k[:, slot // 4, slot % 4], expected_v[:, slot // 4, slot % 4] = k[token], v[token]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_torch_backend_is_the_reference() -> None:
    gen, pool = seeded(7), Pool(4, 1, 2, 16)
    k_cache, v_cache = pool.caches(torch.float32, gen)
    q, tables = pool.queries(2, torch.float32, gen).contiguous(), pool.tables(2, 3, torch.int64, gen)
    lens = torch.tensor([3, 9], device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.5, KernelBackend.TORCH)
    assert torch.equal(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.5))


# ---- the Triton kernels against the references ----------------------------------------------------------


@triton_test
@DTYPES
@pytest.mark.parametrize("is_strided", [False, True], ids=["contiguous", "strided"])
def test_store_kv_triton_writes_exactly_the_addressed_slots(dtype: torch.dtype, is_strided: bool) -> None:
    gen, pool = seeded(4), Pool(block_size=4, num_kv_heads=3, groups=1, head_dim=24, num_blocks=6)
    k_cache, v_cache = pool.caches(dtype, gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(pool.num_blocks * pool.block_size, generator=gen, device=DEVICE)[:14:2]  # strided
    kv = torch.randn(7, 2, 3, 24, generator=gen, device=DEVICE).to(dtype)
    k, v = (kv[:, 0], kv[:, 1]) if is_strided else (kv[:, 0].contiguous(), kv[:, 1].contiguous())
    store_kv(k_cache, v_cache, k, v, slots.to(torch.int32), TRITON)
    store_kv_ref(expected_k, expected_v, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


DECODE_CASES = [
    pytest.param(Pool(4, 1, 1, 16), [1], torch.int32, id="one-token"),
    pytest.param(Pool(8, 3, 3, 64), [5, 17, 33], torch.int64, id="gqa3"),
    pytest.param(Pool(16, 1, 3, 16), [1, 5, 17, 33, 16], torch.int32, id="mqa"),
    pytest.param(Pool(4, 3, 1, 24, num_blocks=64), [33, 2, 9, 1, 20], torch.int64, id="dim24"),
    pytest.param(Pool(64, 1, 2, 256, num_blocks=6), [70, 33], torch.int32, id="dim256"),  # tiles < a block
    pytest.param(
        Pool(16, 8, 4, 128, num_blocks=8192), [1 + i * 997 % 2047 for i in range(32)], torch.int32,
        id="real", marks=ON_GPU,
    ),
]


@triton_test
@DTYPES
@pytest.mark.parametrize("pool, lens, index_dtype", DECODE_CASES)
def test_decode_triton_matches_ref(
    pool: Pool, lens: list[int], index_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    gen, batch = seeded(5), len(lens)
    k_cache, v_cache = pool.caches(dtype, gen)
    max_blocks = -(-max(lens) // pool.block_size) + 1  # one padding block past the longest sequence
    q, tables = pool.queries(batch, dtype, gen), pool.tables(batch, max_blocks, index_dtype, gen)
    context_lens, scale = torch.tensor(lens, dtype=index_dtype, device=DEVICE), pool.head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale, TRITON)
    expected = paged_decode_attention_ref(q.contiguous(), k_cache, v_cache, tables, context_lens, scale)
    assert_close(out, expected, dtype)


PREFILL_CASES = [
    pytest.param(Pool(4, 1, 3, 16), 5, 5, torch.int32, id="whole-prompt"),
    pytest.param(Pool(8, 3, 1, 64), 7, 33, torch.int64, id="chunk"),
    pytest.param(Pool(16, 1, 3, 16), 1, 17, torch.int32, id="one-token"),
    pytest.param(Pool(4, 1, 1, 16), 70, 75, torch.int64, id="two-query-tiles"),
    pytest.param(Pool(16, 8, 4, 128, 256), 500, 1500, torch.int32, id="real-chunk", marks=ON_GPU),
    pytest.param(Pool(16, 8, 4, 128, 256), 1024, 1024, torch.int32, id="real-prompt", marks=ON_GPU),
]


@triton_test
@DTYPES
@pytest.mark.parametrize("pool, num_new, context_len, index_dtype", PREFILL_CASES)
def test_prefill_triton_matches_ref(
    pool: Pool, num_new: int, context_len: int, index_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    gen = seeded(6)
    k_cache, v_cache = pool.caches(dtype, gen)
    q = pool.queries(num_new, dtype, gen)
    table = pool.tables(1, -(-context_len // pool.block_size), index_dtype, gen)[0]
    scale = pool.head_dim**-0.5
    out = paged_prefill_attention(q, k_cache, v_cache, table, context_len, scale, TRITON)
    assert_close(out, paged_prefill_attention_ref(q, k_cache, v_cache, table, context_len, scale), dtype)


# ---- argument checks and the backend switch -------------------------------------------------------------


def _bad_calls() -> dict[str, Callable[[], object]]:
    pool = Pool(4, 2, 2, 16, num_blocks=4)
    k_cache, v_cache = pool.caches(torch.float32, seeded(0))
    q, k = torch.randn(2, 4, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    tables = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3, 5], device=DEVICE)

    def decode(**overrides: object) -> Callable[[], object]:
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, context_lens=lens) | overrides
        return lambda: paged_decode_attention(**args, scale=1.0, backend=TRITON)  # type: ignore[arg-type]

    def prefill(num_new: int, context_len: int) -> Callable[[], object]:
        table = tables[0]
        return lambda: paged_prefill_attention(q[:num_new], k_cache, v_cache, table, context_len, 1.0, TRITON)

    return {
        "dtype mismatch": decode(q=q.half()),
        "head_dim mismatch": decode(q=q[..., :8]),
        "heads not a multiple of kv heads": decode(q=q[:, :3]),
        "float block table": decode(block_tables=tables.float()),
        "block table batch": decode(block_tables=tables[:1]),
        "context_lens shape": decode(context_lens=lens[:1]),
        "v_cache shape": decode(v_cache=v_cache[:, :2]),
        "3-d cache": decode(k_cache=k_cache[0], v_cache=v_cache[0]),
        "two devices": decode(q=q.to("meta")),
        "store k shape": lambda: store_kv(k_cache, v_cache, k[:, :1], k[:, :1], lens[:1].repeat(3), TRITON),
        "store slots shape": lambda: store_kv(k_cache, v_cache, k, k, lens, TRITON),
        "prefill longer than context": prefill(2, 1),
        "prefill table too short": prefill(2, 13),
    }


@triton_test
@pytest.mark.parametrize("name", list(_bad_calls()))
def test_launchers_reject_bad_arguments(name: str) -> None:
    with pytest.raises(ValueError):
        _bad_calls()[name]()


@pytest.mark.parametrize("name", ["cuda", "Torch", "", "tritonn"])
def test_select_backend_rejects_unknown_names(name: str) -> None:
    with pytest.raises(ValueError, match="unknown kernel backend"):
        select_backend(name, torch.device("cpu"))


def test_select_backend_resolves_known_names() -> None:
    cpu = torch.device("cpu")
    # the machines of `make test` have g++ (see test_cpu_kernels_build); auto wants AVX-512 besides
    assert select_backend("auto", cpu) is (KernelBackend.CPU if cpu_has_avx512() else KernelBackend.TORCH)
    assert select_backend("cpu", cpu) is KernelBackend.CPU
    assert select_backend("torch", cpu) is KernelBackend.TORCH
    if triton_available():
        assert select_backend("triton", cpu) is KernelBackend.TRITON


def test_select_backend_refuses_the_cpu_kernels_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="runs on the CPU"):
        select_backend("cpu", torch.device("cuda"))


# ---- the C++ CPU decode kernel against the reference --------------------------------------------------------


def test_the_dispatcher_keeps_the_reference_where_the_kernel_has_no_fast_path() -> None:
    gen, pool = seeded(13, torch.device("cpu")), Pool(4, num_kv_heads=1, groups=2, head_dim=24)
    k_cache, v_cache = pool.caches(torch.float32, gen)
    q, tables, lens = pool.queries(2, torch.float32, gen), pool.tables(2, 2, torch.int32, gen), torch.tensor([5, 8])
    expected = paged_decode_attention_ref(q.contiguous(), k_cache, v_cache, tables, lens, 0.3)
    assert torch.equal(paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3, KernelBackend.CPU), expected)


def test_cpu_kernels_build() -> None:
    """CI and `make test` machines have g++: the engine's default CPU path is the C++ kernel, so it must build."""
    assert cpu_kernels_error() is None


@DTYPES
@pytest.mark.parametrize(
    "pool",
    [Pool(16, num_kv_heads=3, groups=3, head_dim=64, num_blocks=64), Pool(16, num_kv_heads=2, groups=4, head_dim=128,
     num_blocks=64), Pool(5, num_kv_heads=2, groups=8, head_dim=64, num_blocks=64), Pool(4, num_kv_heads=3, groups=2,
     head_dim=24, num_blocks=64)],
    ids=["smollm2", "llama3-8b-heads", "odd-blocks", "generic-head-dim"],  # the last takes the portable loops
)
def test_cpu_decode_kernel_matches_the_reference(pool: Pool, dtype: torch.dtype) -> None:
    gen = seeded(11, torch.device("cpu"))
    k_cache, v_cache = pool.caches(dtype, gen)
    lens = torch.tensor([1, pool.block_size, pool.block_size + 1, 7 * pool.block_size - 3, 17, 33])
    max_blocks = -(-int(lens.max()) // pool.block_size)
    q, tables = pool.queries(len(lens), dtype, gen), pool.tables(len(lens), max_blocks, torch.int32, gen)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens.int(), 0.3)  # the kernel at every head size
    expected = paged_decode_attention_ref(q.contiguous(), k_cache, v_cache, tables, lens, 0.3)
    assert_close(out, expected, dtype)
    for b, context_len in enumerate(lens.tolist()):  # and the dense oracle, row by row
        dense = dense_attention(q[b : b + 1], k_cache, v_cache, tables[b], context_len, 0.3)
        assert_close(out[b : b + 1], dense.to(dtype), dtype)


@DTYPES
def test_cpu_decode_kernel_reads_no_row_past_the_context(dtype: torch.dtype) -> None:
    """Rows past a context's end in its last block (stale or never written) poisoned with NaN change nothing: an odd
    last row is paired with zeros, not with the row after it."""
    gen, pool = seeded(17, torch.device("cpu")), Pool(5, num_kv_heads=2, groups=3, head_dim=64, num_blocks=16)
    k_cache, v_cache = pool.caches(dtype, gen)
    lens = torch.tensor([7, 3, 11])
    q, tables = pool.queries(len(lens), dtype, gen), pool.tables(len(lens), 3, torch.int32, gen)
    for b, context_len in enumerate(lens.tolist()):
        last, used = tables[b, (context_len - 1) // pool.block_size], (context_len - 1) % pool.block_size + 1
        k_cache[:, last, used:] = float("nan")
        v_cache[:, last, used:] = float("nan")
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens.int(), 0.3)
    for b, context_len in enumerate(lens.tolist()):
        dense = dense_attention(q[b : b + 1], k_cache, v_cache, tables[b], context_len, 0.3)
        assert_close(out[b : b + 1], dense.to(dtype), dtype)


@pytest.mark.parametrize(
    "lens, bad_block, match",
    [([0, 3], None, "outside"), ([9, 3], None, "outside"), ([3, 3], 40, "not a block"), ([3, 3], -1, "not a block")],
    ids=["empty-context", "past-the-table", "block-past-the-pool", "negative-block"],
)
def test_cpu_decode_kernel_refuses_what_would_read_outside_the_pool(
    lens: list[int], bad_block: int | None, match: str
) -> None:
    gen, pool = seeded(12, torch.device("cpu")), Pool(block_size=4, num_kv_heads=1, groups=2, head_dim=64)
    k_cache, v_cache = pool.caches(torch.float32, gen)
    q, tables = pool.queries(2, torch.float32, gen), pool.tables(2, 2, torch.int32, gen)
    if bad_block is not None:
        tables[1, 0] = bad_block
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_cpu(q, k_cache, v_cache, tables, torch.tensor(lens).int(), 0.3)


# ---- the C++ CPU prefill kernel against the reference --------------------------------------------------------

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
def test_the_cpu_prefill_kernel_is_taken_only_where_it_has_a_fast_path() -> None:
    assert prefill_takes_cpu_kernel(KernelBackend.CPU, torch.bfloat16, 64)
    assert prefill_takes_cpu_kernel(KernelBackend.CPU, torch.bfloat16, 128)
    assert not prefill_takes_cpu_kernel(KernelBackend.TORCH, torch.bfloat16, 64)
    assert not prefill_takes_cpu_kernel(KernelBackend.CPU, torch.float32, 64)
    assert not prefill_takes_cpu_kernel(KernelBackend.CPU, torch.bfloat16, 24)


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
