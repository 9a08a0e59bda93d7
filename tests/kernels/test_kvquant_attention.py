"""Decode attention over kvquant pool rows: the reference against a dense float64 oracle built from the codec's byte
decode and the model's RoPE; the fused Triton kernel against the reference (interpreted on CPU at small odd shapes,
see conftest.py; on CUDA also at a real shape); argument checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kernels.backend import KernelBackend
from kernels.kvquant_attention import kvquant_decode_attention, kvquant_decode_attention_ref
from kernels.kvquant_attention_triton import kvquant_decode_attention_triton
from kernels.kvquant_layout import KvQuantLayerParams
from kernels.kvquant_pack import kvquant_pack_ref
from kernels.layer_ops import apply_rotary_ref
from shared.kvcompress.kvquant import KvQuantCodec
from shared.model.llama import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="real shapes are too slow for the interpreter")
TOLERANCES = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # atol = rtol, per dtype


@dataclass(frozen=True)
class Case:
    bits: int
    kv_heads: int
    groups: int
    block_size: int
    head_dim: int
    seqs: tuple[tuple[int, int], ...]  # (packed blocks, tail tokens) per sequence
    fraction: float = 0.01


@dataclass
class Batch:
    """Every argument of the decode attention but the scale, and what built the pool."""

    q: torch.Tensor
    pool: torch.Tensor
    tables: torch.Tensor
    num_packed: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    tail_lens: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    params: KvQuantLayerParams
    rope: RotaryEmbedding

    def args(self) -> tuple[object, ...]:
        return (self.q, self.pool, self.tables, self.num_packed, self.tail_k, self.tail_v, self.tail_lens,
                self.sink_k, self.sink_v, self.params)


def codec_of(params: KvQuantLayerParams) -> KvQuantCodec:
    """The `KvQuantCodec` of the params' calibration: the byte oracle the kernels' rows are checked against."""
    return KvQuantCodec(
        params.layout.bits, params.key_center, params.key_scale, params.key_codebook, params.value_codebook,
        params.outlier_fraction,
    )


def make_batch(case: Case, dtype: torch.dtype, seed: int = 0) -> Batch:
    """A pool of random packed blocks (spare ones too), shuffled tables, random tails and sinks (unlike token 0)."""
    g = torch.Generator().manual_seed(seed)
    heads, dim, tokens = case.kv_heads, case.head_dim, case.block_size
    center, scale = torch.randn(heads, dim, generator=g) * 0.5, torch.rand(heads, dim, generator=g) + 1.0
    key_cb, value_cb = (torch.sort(torch.rand(1 << case.bits, generator=g) * 2.2 - 1.1).values for _ in range(2))
    codec = KvQuantCodec(case.bits, center, scale, key_cb, value_cb, case.fraction)
    max_blocks = max(packed for packed, _ in case.seqs) + 1
    rope = RotaryEmbedding(dim, max_blocks * tokens, 10000.0).to(DEVICE)
    params = KvQuantLayerParams.from_tables(codec.tables, tokens, rope.cos, rope.sin)
    batch, num_blocks = len(case.seqs), len(case.seqs) * max_blocks + 2
    shape = (num_blocks, heads, tokens, dim)
    k = torch.randn(shape, generator=g) * 1.5 + center[:, None, :]
    v = torch.randn(shape, generator=g) * (torch.rand(tokens, 1, generator=g) + 0.2)
    pool = kvquant_pack_ref(k.to(DEVICE), v.to(DEVICE), params)
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)

    def rand(*size: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(DEVICE, dt)

    return Batch(
        q=rand(batch, heads * case.groups, dim), pool=pool, tables=tables.to(DEVICE, torch.int32),
        num_packed=torch.tensor([p for p, _ in case.seqs], device=DEVICE),
        tail_k=rand(batch, heads, tokens, dim), tail_v=rand(batch, heads, tokens, dim),
        tail_lens=torch.tensor([t for _, t in case.seqs], dtype=torch.int32, device=DEVICE),
        sink_k=rand(batch, heads, dim, dt=torch.float16), sink_v=rand(batch, heads, dim, dt=torch.float16),
        params=params, rope=rope,
    )


def dense_oracle(batch: Batch, b: int, scale: float) -> torch.Tensor:
    """float64 softmax(q K^T) V of sequence b, K and V from the codec's byte decode of each row, RoPE by the model."""
    layout = batch.params.layout
    heads, tokens, dim = layout.kv_heads, layout.block_size, layout.head_dim
    codec, keys, values = codec_of(batch.params), [], []
    for i in range(int(batch.num_packed[b])):
        data = bytes(batch.pool[int(batch.tables[b, i])].cpu().numpy())
        k, v = codec.decode(data, heads, tokens, dim, torch.float64)  # [H, T, D]
        keys.append(k)
        values.append(v)
    k = torch.cat(keys, dim=1) if keys else torch.zeros(heads, 0, dim, dtype=torch.float64)
    v = torch.cat(values, dim=1) if values else torch.zeros(heads, 0, dim, dtype=torch.float64)
    if keys:
        k[:, 0], v[:, 0] = batch.sink_k[b].cpu().double(), batch.sink_v[b].cpu().double()
    cos, sin = batch.rope.cpu().cos_sin(torch.arange(k.shape[1]), torch.float64)
    k = apply_rotary_ref(k.transpose(0, 1), cos, sin).transpose(0, 1)
    tail = int(batch.tail_lens[b])
    k = torch.cat([k, batch.tail_k[b, :, :tail].cpu().double()], dim=1)
    v = torch.cat([v, batch.tail_v[b, :, :tail].cpu().double()], dim=1)
    groups = batch.q.shape[1] // heads
    k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)  # [num_heads, tokens, D]
    scores = torch.einsum("hd,htd->ht", batch.q[b].cpu().double(), k) * scale
    return torch.einsum("ht,htd->hd", scores.softmax(dim=-1), v)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and actual.shape == expected.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# ---- the reference against the dense oracle (CPU) -------------------------------------------------------

REF_CASES = [
    pytest.param(Case(2, 2, 3, 16, 64, ((3, 5), (0, 7), (2, 0), (1, 16))), id="b2-gqa3-mixed"),
    pytest.param(Case(3, 1, 1, 64, 32, ((2, 33), (1, 0))), id="b3-t64-d32"),
    pytest.param(Case(4, 3, 1, 16, 32, ((4, 1),), fraction=0.0), id="b4-no-outliers"),
]


@pytest.mark.parametrize("case", REF_CASES)
def test_ref_matches_the_dense_oracle(case: Case) -> None:
    batch, scale = make_batch(case, torch.float32), case.head_dim**-0.5
    out = kvquant_decode_attention_ref(*batch.args(), scale)
    for b in range(len(case.seqs)):
        torch.testing.assert_close(out[b].cpu(), dense_oracle(batch, b, scale).float(), atol=1e-5, rtol=1e-5)


def test_the_sink_the_key_ranges_and_the_value_outliers_change_the_output() -> None:
    """Guards the comparisons above: a kernel that ignored any of them would be caught by them."""
    batch, scale = make_batch(Case(3, 2, 1, 16, 32, ((3, 4),)), torch.float32), 32**-0.5
    out = kvquant_decode_attention_ref(*batch.args(), scale)
    layout = batch.params.layout
    other_range = batch.pool.clone()
    k_high = other_range[int(batch.tables[0, 1]), layout.k_high_offset : layout.v_center_offset]
    k_high.copy_((k_high.int() + 4).clamp(max=255))  # wider key ranges in one block
    no_v_outliers = batch.pool.clone()
    no_v_outliers[:, layout.v_corr_offset :] = 0  # the value corrections
    other_sink = batch.sink_k.clone()
    other_sink[0, :, 1] += 1.0
    for changed in ({"pool": other_range}, {"pool": no_v_outliers}, {"sink_k": other_sink}):
        args = dict(zip(("q", "pool", "tables", "num_packed", "tail_k", "tail_v", "tail_lens", "sink_k", "sink_v",
                         "params"), batch.args(), strict=True)) | changed
        assert (kvquant_decode_attention_ref(*args.values(), scale) - out).abs().max() > 1e-3


def test_a_sequence_without_tokens_is_refused() -> None:
    batch = make_batch(Case(2, 1, 1, 16, 32, ((1, 2), (0, 0))), torch.float32)
    with pytest.raises(ValueError, match="no token"):
        kvquant_decode_attention_ref(*batch.args(), 0.1)


def test_the_torch_backend_is_the_reference() -> None:
    batch = make_batch(Case(2, 1, 2, 16, 32, ((2, 3),)), torch.float32)
    expected = kvquant_decode_attention_ref(*batch.args(), 0.2)
    assert torch.equal(kvquant_decode_attention(*batch.args(), 0.2, KernelBackend.TORCH), expected)


# ---- the Triton kernel against the reference ------------------------------------------------------------

TRITON_CASES = [  # (case, dtype, units per split: None = the launcher's choice)
    pytest.param(REF_CASES[0].values[0], torch.float32, 1, id="b2-gqa3-mixed-split1"),
    pytest.param(REF_CASES[0].values[0], torch.float16, None, id="b2-gqa3-mixed-fp16"),
    pytest.param(REF_CASES[1].values[0], torch.float32, 2, id="b3-t64-d32-split2"),
    pytest.param(Case(3, 2, 3, 16, 32, ((3, 0), (2, 9))), torch.bfloat16, 2, id="b3-gqa3-bf16"),
    pytest.param(Case(4, 1, 3, 16, 64, ((5, 3), (0, 1), (1, 0))), torch.float16, 3, id="b4-gqa3-fp16"),
    pytest.param(Case(4, 2, 1, 64, 64, ((1, 64), (2, 17))), torch.float32, None, id="b4-t64-d64-full-tail"),
    pytest.param(REF_CASES[2].values[0], torch.float32, 2, id="b4-no-outliers"),
    # one query head per KV head (the elementwise path, per-token V accumulation) with many value outliers (n = 41,
    # padded to 64) in fp16, 2 bits (pairs of 4-bit indices) and 4 bits (a byte a pair)
    pytest.param(Case(2, 2, 1, 32, 64, ((3, 5), (1, 0)), fraction=0.02), torch.float16, 2, id="b2-mha-outliers-fp16"),
    pytest.param(Case(4, 3, 1, 16, 128, ((2, 7), (3, 16))), torch.float16, None, id="b4-mha-d128-fp16"),
    pytest.param(Case(3, 32, 1, 64, 128, tuple((1 + i * 7 % 24, 9 * i % 65) for i in range(8))), torch.float16, None,
                 id="real", marks=ON_GPU),
]


@pytest.mark.usefixtures("triton_ready")
@pytest.mark.parametrize("case, dtype, units_per_split", TRITON_CASES)
def test_triton_matches_the_ref(case: Case, dtype: torch.dtype, units_per_split: int | None) -> None:
    batch, scale = make_batch(case, dtype), case.head_dim**-0.5
    out = kvquant_decode_attention_triton(*batch.args(), scale, units_per_split=units_per_split)
    assert_close(out, kvquant_decode_attention_ref(*batch.args(), scale), dtype)


@pytest.mark.usefixtures("triton_ready")
def test_the_triton_backend_is_the_kernel() -> None:
    batch = make_batch(Case(2, 1, 1, 16, 32, ((2, 3),)), torch.float32)
    out = kvquant_decode_attention(*batch.args(), 0.2, KernelBackend.TRITON)
    assert_close(out, kvquant_decode_attention_ref(*batch.args(), 0.2), torch.float32)


def _bad_calls() -> dict[str, Callable[[], object]]:
    batch = make_batch(Case(2, 2, 2, 16, 32, ((1, 2), (2, 0))), torch.float32)
    names = ("q", "packed_pool", "block_tables", "num_packed_blocks", "tail_k", "tail_v", "tail_lens", "sink_k",
             "sink_v", "params")
    base = dict(zip(names, batch.args(), strict=True))

    def call(**overrides: object) -> Callable[[], object]:
        return lambda: kvquant_decode_attention_triton(**(base | overrides), scale=0.1)  # type: ignore[arg-type]

    return {
        "q head_dim": call(q=batch.q[..., :16]),
        "heads not a multiple of kv heads": call(q=batch.q[:, :3]),
        "pool width": call(packed_pool=batch.pool[:, 2:]),
        "pool dtype": call(packed_pool=batch.pool.view(torch.int8)),
        "float block table": call(block_tables=batch.tables.float()),
        "block table batch": call(block_tables=batch.tables[:1]),
        "counts shape": call(tail_lens=batch.tail_lens[:1]),
        "tail dtype": call(tail_k=batch.tail_k.half(), tail_v=batch.tail_v.half()),
        "tail shape": call(tail_v=batch.tail_v[:, :, :8]),
        "sink shape": call(sink_k=batch.sink_k[:, :1]),
        "two devices": call(q=batch.q.to("meta")),
    }


@pytest.mark.usefixtures("triton_ready")
@pytest.mark.parametrize("name", list(_bad_calls()))
def test_launcher_rejects_bad_arguments(name: str) -> None:
    with pytest.raises(ValueError):
        _bad_calls()[name]()
