"""The C++ CPU kernels (`kernels/csrc`, `kernels.paged_attention_cpu`): that they build from every source, the store
of a step's K/V and the decode attention (AVX-512 and, where the CPU has them, AMX tiles) against the references and
the dense oracle, what they must never read or write, their refusals, and where the dispatcher keeps the reference.
The prefill kernel: test_prefill_attention_cpu.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels.backend import KernelBackend
from kernels.cpu_build import CSRC, HEADERS, SOURCES, cpu_kernels_error
from kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref, store_kv, store_kv_ref
from kernels.paged_attention_cpu import paged_decode_attention_cpu
from tests.kernels.paged_cases import DTYPES, Pool, assert_close, dense_attention, seeded


def test_the_dispatcher_keeps_the_reference_where_the_kernel_has_no_fast_path() -> None:
    gen, pool = seeded(13, torch.device("cpu")), Pool(4, num_kv_heads=1, groups=2, head_dim=24)
    k_cache, v_cache = pool.caches(torch.float32, gen)
    q, tables, lens = pool.queries(2, torch.float32, gen), pool.tables(2, 2, torch.int32, gen), torch.tensor([5, 8])
    expected = paged_decode_attention_ref(q.contiguous(), k_cache, v_cache, tables, lens, 0.3)
    assert torch.equal(paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3, KernelBackend.CPU), expected)


def test_cpu_kernels_build() -> None:
    """CI and `make test` machines have g++: the engine's default CPU path is the C++ kernel, so it must build."""
    assert cpu_kernels_error() is None


def test_every_kernel_source_is_built_and_hashed() -> None:
    """A source or header left out of the lists would be left out of the build's name, and an edit to it would
    load the stale library built before."""
    assert {path.name for path in CSRC.iterdir()} == {path.name for path in SOURCES + HEADERS}


@DTYPES
@pytest.mark.parametrize("num_tokens", [7, 600], ids=["decode-rows", "prefill-rows"])  # 600: split over threads
def test_cpu_store_writes_exactly_what_the_reference_stores(dtype: torch.dtype, num_tokens: int) -> None:
    gen, pool = seeded(14, torch.device("cpu")), Pool(block_size=16, num_kv_heads=3, groups=3, head_dim=64,
                                                       num_blocks=48)
    k_cache, v_cache = pool.caches(dtype, gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(pool.num_blocks * pool.block_size, generator=gen)[:num_tokens]
    fused = torch.randn(num_tokens, pool.num_heads + 2 * pool.num_kv_heads, 64, generator=gen).to(dtype)
    _, k, v = fused.split([pool.num_heads, pool.num_kv_heads, pool.num_kv_heads], dim=1)  # strided, as the model's
    store_kv(k_cache, v_cache, k, v, slots, KernelBackend.CPU)
    store_kv_ref(expected_k, expected_v, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("change, match", [("slot-past-the-pool", "not a slot"), ("negative-slot", "not a slot"),
                                           ("rows-for-slots", "rows for"), ("dtype", "the pool"),
                                           ("heads", "KV heads")])
def test_cpu_store_refuses_what_would_write_outside_the_pool(change: str, match: str) -> None:
    gen, pool = seeded(15, torch.device("cpu")), Pool(block_size=4, num_kv_heads=2, groups=1, head_dim=64,
                                                      num_blocks=4)
    k_cache, v_cache = pool.caches(torch.float32, gen)
    before = k_cache.clone()
    k = v = torch.randn(3, 2, 64, generator=gen)
    slots = torch.tensor({"slot-past-the-pool": [0, 16, 1], "negative-slot": [0, -1, 1]}.get(change, [0, 5, 1]))
    if change == "rows-for-slots":
        slots = slots[:2]
    elif change == "dtype":
        k = v = k.half()
    elif change == "heads":
        k = v = k[:, :1]
    with pytest.raises(ValueError, match=match):
        store_kv(k_cache, v_cache, k, v, slots, KernelBackend.CPU)
    assert torch.equal(k_cache, before)  # checked before the first row is written


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
@pytest.mark.parametrize("block_size, context_lens", [(5, [7, 3, 11]), (16, [7, 3, 40])], ids=["odd-blocks", "tiles"])
def test_cpu_decode_kernel_reads_no_row_past_the_context(
    dtype: torch.dtype, block_size: int, context_lens: list[int]
) -> None:
    """Rows past a context's end in its last block (stale or never written) poisoned with NaN change nothing: an odd
    last row is paired with zeros, not with the row after it, and on AMX (blocks of 16) the scores of a whole tile of
    16 rows are computed but those past the end never weighed."""
    gen = seeded(17, torch.device("cpu"))
    pool = Pool(block_size, num_kv_heads=2, groups=3, head_dim=64, num_blocks=16)
    k_cache, v_cache = pool.caches(dtype, gen)
    lens = torch.tensor(context_lens)
    q, tables = pool.queries(len(lens), dtype, gen), pool.tables(len(lens), 3, torch.int32, gen)
    for b, context_len in enumerate(lens.tolist()):
        last, used = tables[b, (context_len - 1) // pool.block_size], (context_len - 1) % pool.block_size + 1
        k_cache[:, last, used:] = float("nan")
        v_cache[:, last, used:] = float("nan")
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens.int(), 0.3)
    for b, context_len in enumerate(lens.tolist()):
        dense = dense_attention(q[b : b + 1], k_cache, v_cache, tables[b], context_len, 0.3)
        assert_close(out[b : b + 1], dense.to(dtype), dtype)


def test_cpu_decode_kernel_over_long_contexts_matches_the_reference() -> None:
    """Contexts of many 32-token tiles and of none, bf16 at SmolLM2's and Llama-3-8B's heads."""
    for pool in (Pool(16, num_kv_heads=3, groups=3, head_dim=64, num_blocks=110),
                 Pool(16, num_kv_heads=2, groups=4, head_dim=128, num_blocks=110)):
        gen = seeded(18, torch.device("cpu"))
        k_cache, v_cache = pool.caches(torch.bfloat16, gen)
        lens = torch.tensor([300, 2, 31, 32, 333])  # 333: 21 blocks, the last one 13 tokens
        q, tables = pool.queries(len(lens), torch.bfloat16, gen), pool.tables(len(lens), 21, torch.int32, gen)
        out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens.int(), 0.125)
        assert_close(out, paged_decode_attention_ref(q.contiguous(), k_cache, v_cache, tables, lens, 0.125),
                     torch.bfloat16)


def test_cpu_decode_kernel_leaves_other_bf16_kernels_as_they_were() -> None:
    """On AMX the kernel configures the tile registers of each thread it runs on; PyTorch's flash attention and
    oneDNN's matmuls use them too. Their results after it are bit for bit their results before."""
    gen, pool = seeded(19, torch.device("cpu")), Pool(16, num_kv_heads=3, groups=3, head_dim=64, num_blocks=64)
    k_cache, v_cache = pool.caches(torch.bfloat16, gen)
    q, tables, lens = pool.queries(8, torch.bfloat16, gen), pool.tables(8, 4, torch.int32, gen), torch.full((8,), 60)
    x, w = torch.randn(64, 576, generator=gen).bfloat16(), torch.randn(960, 576, generator=gen).bfloat16()
    can_pack = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None) if can_pack else w
    qs, ks, vs = (torch.randn(2, 9, 256, 64, generator=gen).bfloat16() for _ in range(3))

    def others() -> tuple[torch.Tensor, torch.Tensor]:
        matmul = (torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "") if packed is not w
                  else torch.nn.functional.linear(x, w))
        return matmul, torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    before = others()
    for _ in range(3):
        out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens.int(), 0.125)
        after = others()
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert_close(out, paged_decode_attention_ref(q.contiguous(), k_cache, v_cache, tables, lens, 0.125),
                 torch.bfloat16)


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
