"""Paged attention: references against a dense per-token oracle; Triton kernels against the references
(interpreted on CPU at small odd shapes, see conftest.py; on CUDA also at real shapes); argument checks and the
backend switch. The C++ CPU kernels: test_paged_attention_cpu.py (build, store, decode) and
test_prefill_attention_cpu.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.backend import KernelBackend, select_backend, triton_available
from kernels.cpu_build import cpu_has_avx512
from kernels.paged_attention import (
    fresh_prefill_attention_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_padded_ref,
    paged_prefill_attention_ref,
    store_kv,
    store_kv_ref,
)
from tests.kernels.paged_cases import DEVICE, DTYPES, Pool, assert_close, dense_attention, seeded

ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="real shapes are too slow for the interpreter")
TRITON = KernelBackend.TRITON


def triton_test(test: Callable[..., None]) -> Callable[..., None]:
    """Fail with the reason when triton is missing (it is a test extra) or its interpreter cannot run."""
    return pytest.mark.usefixtures("triton_ready")(test)


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
