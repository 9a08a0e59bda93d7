"""kvquant pool rows: the layout against the codec's bytes, the torch value outlier choice against the codec's, the
key ranges of sequence-starting blocks (the sink left out), and the fused Triton quantize-and-pack bit-identical to
the reference (interpreted on CPU at small odd shapes, see conftest.py; on CUDA also at a real shape).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.backend import KernelBackend
from kernels.kvquant_layout import KvQuantLayerParams, KvQuantLayout
from kernels.kvquant_pack import kvquant_pack, kvquant_pack_ref, select_outliers
from kernels.kvquant_pack_triton import kvquant_pack_triton
from shared.kvcompress.kvquant import KvQuantCodec

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="real shapes are too slow for the interpreter")


def codec_of(params: KvQuantLayerParams) -> KvQuantCodec:
    """The `KvQuantCodec` of the params' calibration: the byte oracle the kernels' rows are checked against."""
    return KvQuantCodec(
        params.layout.bits, params.key_center, params.key_scale, params.key_codebook, params.value_codebook,
        params.outlier_fraction,
    )


def make_params(
    bits: int, heads: int, dim: int, block_size: int, fraction: float = 0.01, device: torch.device = DEVICE
) -> KvQuantLayerParams:
    """Synthetic calibration: random key grids, random ascending codebooks around [-1, 1]."""
    g = torch.Generator().manual_seed(bits * 100 + heads * 10 + dim)
    center, scale = torch.randn(heads, dim, generator=g) * 0.5, torch.rand(heads, dim, generator=g) + 1.0
    key_cb, value_cb = (torch.sort(torch.rand(1 << bits, generator=g) * 2.2 - 1.1).values for _ in range(2))
    codec = KvQuantCodec(bits, center, scale, key_cb, value_cb, fraction)
    tables = torch.randn(2, 4 * block_size, dim // 2, generator=g).to(device)
    return KvQuantLayerParams.from_tables(codec.tables, block_size, tables[0], tables[1])


def random_blocks(
    num_blocks: int, layout: KvQuantLayout, dtype: torch.dtype = torch.float32, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """K (before RoPE) and V [num_blocks, H, T, D]: keys spread past some grids' ends (clamped ranges), values with
    outliers that matter."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, layout.kv_heads, layout.block_size, layout.head_dim)
    k = torch.randn(shape, generator=g) * 1.5 + 0.3
    v = torch.randn(shape, generator=g) * (torch.rand(shape[2], 1, generator=g) + 0.2) - 0.1
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


# ---- the layout and the torch side against the codec ----------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("heads, block_size, dim", [(1, 16, 32), (3, 64, 64), (2, 5, 24)])
def test_a_pool_row_is_the_codecs_bytes_of_a_block(bits: int, heads: int, block_size: int, dim: int) -> None:
    params = make_params(bits, heads, dim, block_size, device=torch.device("cpu"))
    k, v = (t.cpu() for t in random_blocks(3, params.layout))
    rows = kvquant_pack_ref(k, v, params)
    codec = codec_of(params)
    assert rows.shape == (3, codec.num_bytes(heads, block_size, dim))
    for b in range(3):
        assert bytes(rows[b].numpy()) == codec.encode(k[b], v[b])
    assert torch.equal(codec.to_rows(codec.from_rows(rows, None, heads, block_size, dim))[0], rows)


def test_a_first_blocks_row_and_its_sink_are_the_codecs_bytes_of_a_sequence_start() -> None:
    """The engine can ship a sequence's first block as its row + its sink: exactly what the codec would encode."""
    params = make_params(3, 2, 32, 16, device=torch.device("cpu"))
    k, v = (t.cpu() for t in random_blocks(1, params.layout))
    k[:, :, 0] *= 8.0  # token 0 far out: a block that did not start a sequence would widen its key ranges
    row = kvquant_pack_ref(k, v, params, starts_sequence=True)[0]
    sink = torch.stack([k[0, :, 0], v[0, :, 0]]).half()  # K [H, D] then V [H, D]
    expected = codec_of(params).encode(k[0], v[0], starts_sequence=True)
    assert bytes(row.numpy()) + bytes(sink.view(torch.uint8).numpy()) == expected
    assert bytes(row.numpy()) != bytes(kvquant_pack_ref(k, v, params)[0].numpy())


@pytest.mark.parametrize("bits, starts_sequence", [(2, False), (4, True)])
def test_select_outliers_picks_the_codecs_value_outliers(bits: int, starts_sequence: bool) -> None:
    params = make_params(bits, 3, 64, 16)
    k, v = random_blocks(4, params.layout)
    v[:, 1, 0, 5] = 40.0  # token 0's value far out: an outlier unless token 0 is the sink
    v_index = select_outliers(v, params, starts_sequence=starts_sequence)
    packed = codec_of(params).encode_blocks(k.cpu(), v.cpu(), starts_sequence=starts_sequence)
    assert v_index.shape == (4, 3, params.layout.num_outliers) and params.layout.num_outliers > 0
    assert torch.equal(v_index.cpu(), packed.v_outlier_index)
    assert bool((v_index[:, 1] == 5).any(dim=1).all()) is not starts_sequence


def test_select_outliers_without_outliers_is_empty() -> None:
    params = make_params(3, 2, 32, 16, fraction=0.0)
    assert select_outliers(random_blocks(2, params.layout)[1], params).shape == (2, 2, 0)


def key_range_bytes(rows: torch.Tensor, params: KvQuantLayerParams) -> torch.Tensor:
    """The K low and K high sections of pool rows, uint8 [B, 2 * H * D]."""
    return rows[:, params.layout.k_low_offset : params.layout.v_center_offset]


@pytest.mark.parametrize("backend", [KernelBackend.TORCH, KernelBackend.TRITON])
def test_a_huge_sink_does_not_widen_the_key_ranges(backend: KernelBackend, request: pytest.FixtureRequest) -> None:
    """A sequence-starting block's key ranges are its other tokens' (the sink is stored whole): those of the same
    block with token 0 a copy of token 1, which a huge token 0 would widen in any other block."""
    if backend is KernelBackend.TRITON:
        request.getfixturevalue("triton_ready")
    params = make_params(3, 2, 32, 16, fraction=0.03)
    k, v = random_blocks(2, params.layout, seed=5)
    k[:, :, 0] = 1e4
    k[1, 1, 0] = -1e4
    rows = kvquant_pack(k, v, params, backend, starts_sequence=True)
    no_sink = k.clone()
    no_sink[:, :, 0] = k[:, :, 1]
    expected = key_range_bytes(kvquant_pack(no_sink, v, params, backend), params)
    assert torch.equal(key_range_bytes(rows, params), expected)
    widened = key_range_bytes(kvquant_pack(k, v, params, backend), params)
    assert not torch.equal(widened, expected)
    assert torch.equal(rows, kvquant_pack_ref(k, v, params, starts_sequence=True))


def test_the_torch_backend_is_the_reference() -> None:
    params = make_params(3, 2, 32, 16)
    k, v = random_blocks(2, params.layout)
    assert torch.equal(kvquant_pack(k, v, params, KernelBackend.TORCH), kvquant_pack_ref(k, v, params))


# ---- the Triton kernel against the reference ------------------------------------------------------------

PACK_CASES = [
    pytest.param(2, 1, 16, 32, torch.float32, 0.01, id="b2-h1-t16-d32"),
    pytest.param(3, 3, 16, 64, torch.float32, 0.01, id="b3-h3-t16-d64"),
    pytest.param(4, 2, 64, 32, torch.float16, 0.01, id="b4-h2-t64-d32-fp16"),
    pytest.param(3, 2, 64, 64, torch.bfloat16, 0.01, id="b3-h2-t64-d64-bf16"),
    pytest.param(2, 3, 64, 64, torch.float32, 0.03, id="b2-many-outliers"),
    pytest.param(4, 1, 16, 32, torch.float32, 0.0, id="b4-no-outliers"),
    pytest.param(3, 32, 64, 128, torch.float16, 0.01, id="real", marks=ON_GPU),
]


@pytest.mark.usefixtures("triton_ready")
@pytest.mark.parametrize("bits, heads, block_size, dim, dtype, fraction", PACK_CASES)
def test_pack_triton_is_bit_identical_to_the_reference(
    bits: int, heads: int, block_size: int, dim: int, dtype: torch.dtype, fraction: float
) -> None:
    params = make_params(bits, heads, dim, block_size, fraction)
    k, v = random_blocks(3 if DEVICE.type == "cpu" else 64, params.layout, dtype)
    starts_sequence = bits == 3  # token 0 out of the value outliers (the torch side's choice) and the key ranges
    if starts_sequence:
        k[:, :, 0] *= 4.0  # far out: it would widen them
    rows = kvquant_pack(k, v, params, KernelBackend.TRITON, starts_sequence=starts_sequence)
    expected = kvquant_pack_ref(k, v, params, starts_sequence=starts_sequence)
    assert rows.dtype == torch.uint8 and rows.shape == expected.shape
    assert torch.equal(rows, expected), f"{int((rows != expected).sum())} bytes differ"


@pytest.mark.usefixtures("triton_ready")
def test_pack_triton_rounds_ties_to_the_lower_entry_as_the_codec_does() -> None:
    """Keys exactly on the key codebook's midpoints in units of their block range, with exact arithmetic: a grid of
    base 0 and step 2**-5, each channel's range grid points 100..132 (tokens 0 and 1), so centre 116 and half-range
    16 steps, and dyadic midpoints."""
    bits, heads, tokens, dim = 3, 1, 16, 32
    codebook = torch.tensor([-1.0, -0.625, -0.375, -0.125, 0.0, 0.25, 0.5, 1.0])
    scale = torch.full((heads, dim), 255 / 128)  # key_grid: base = centre - 2 * scale = 0, step = 2**-5
    codec = KvQuantCodec(bits, 2 * scale, scale, codebook, codebook.clone(), 0.01)
    tables = torch.zeros(2, tokens, dim // 2, device=DEVICE)
    params = KvQuantLayerParams.from_tables(codec.tables, tokens, tables[0], tables[1])
    step, center, half = 2.0**-5, 116 * 2.0**-5, 16 * 2.0**-5
    midpoints = (codebook[1:] + codebook[:-1]) / 2
    k = center + midpoints[torch.arange(tokens * dim) % 7].view(1, heads, tokens, dim) * half
    k[:, :, 0], k[:, :, 1] = 100 * step, 132 * step
    v = torch.randn(1, heads, tokens, dim, generator=torch.Generator().manual_seed(3))
    decoded, _ = codec.decode_blocks(codec.encode_blocks(k, v), heads, tokens, dim)
    lower = center + codebook[torch.arange(tokens * dim) % 7].view(1, heads, tokens, dim) * half
    assert torch.equal(decoded[:, :, 2:], lower[:, :, 2:])  # the codec rounds each tie down
    k, v = k.to(DEVICE), v.to(DEVICE)
    assert torch.equal(kvquant_pack(k, v, params, KernelBackend.TRITON), kvquant_pack_ref(k, v, params))


def _bad_pack_calls() -> dict[str, Callable[[], object]]:
    params = make_params(3, 2, 32, 16)
    k, v = random_blocks(2, params.layout)
    v_index = select_outliers(v, params)

    def pack(**overrides: object) -> Callable[[], object]:
        args = {"k": k, "v": v, "v_outlier_index": v_index, "params": params}
        return lambda: kvquant_pack_triton(**(args | overrides))  # type: ignore[arg-type]

    odd = make_params(3, 2, 24, 16)
    return {
        "v shape": pack(v=v[:, :1]),
        "int k": pack(k=k.int()),
        "index shape": pack(v_outlier_index=v_index[..., :-1]),
        "float index": pack(v_outlier_index=v_index.float()),
        "two devices": pack(k=k.to("meta")),
        "head_dim not a power of two": pack(k=k[..., :24], v=v[..., :24], params=odd),
    }


@pytest.mark.usefixtures("triton_ready")
@pytest.mark.parametrize("name", list(_bad_pack_calls()))
def test_pack_launcher_rejects_bad_arguments(name: str) -> None:
    with pytest.raises(ValueError):
        _bad_pack_calls()[name]()
