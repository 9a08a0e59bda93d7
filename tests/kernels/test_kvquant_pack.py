"""kvquant pool rows: the layout against the codec's bytes, the torch outlier choice against the codec's, and the
fused Triton quantize-and-pack bit-identical to the reference (interpreted on CPU at small odd shapes, see
conftest.py; on CUDA also at a real shape).
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


def make_params(
    bits: int, heads: int, dim: int, block_size: int, fraction: float = 0.01, device: torch.device = DEVICE
) -> KvQuantLayerParams:
    """Synthetic calibration: random key ranges, random ascending codebooks around [-1, 1]."""
    g = torch.Generator().manual_seed(bits * 100 + heads * 10 + dim)
    center, scale = torch.randn(heads, dim, generator=g) * 0.5, torch.rand(heads, dim, generator=g) + 1.0
    key_cb, value_cb = (torch.sort(torch.rand(1 << bits, generator=g) * 2.2 - 1.1).values for _ in range(2))
    codec = KvQuantCodec(bits, center, scale, key_cb, value_cb, fraction)
    tables = torch.randn(2, 4 * block_size, dim // 2, generator=g).to(device)
    return KvQuantLayerParams.from_codec(codec, block_size, tables[0], tables[1])


def random_blocks(
    num_blocks: int, layout: KvQuantLayout, dtype: torch.dtype = torch.float32, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """K (before RoPE) and V [num_blocks, H, T, D]: spread beyond the calibrated range, so outliers matter."""
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
    codec = params.codec()
    assert rows.shape == (3, codec.num_bytes(heads, block_size, dim))
    for b in range(3):
        assert bytes(rows[b].numpy()) == codec.encode(k[b], v[b])
    assert torch.equal(codec.to_rows(codec.from_rows(rows, None, heads, block_size, dim))[0], rows)


def test_a_first_blocks_row_and_its_sink_are_the_codecs_bytes_of_a_sequence_start() -> None:
    """The engine can ship a sequence's first block as its row + its sink: exactly what the codec would encode."""
    params = make_params(3, 2, 32, 16, device=torch.device("cpu"))
    k, v = (t.cpu() for t in random_blocks(1, params.layout))
    k[:, :, 0] *= 8.0  # token 0 far out: a block that did not start a sequence would take outliers there
    row = kvquant_pack_ref(k, v, params, starts_sequence=True)[0]
    sink = torch.stack([k[0, :, 0], v[0, :, 0]]).half()  # K [H, D] then V [H, D]
    expected = params.codec().encode(k[0], v[0], starts_sequence=True)
    assert bytes(row.numpy()) + bytes(sink.view(torch.uint8).numpy()) == expected
    assert bytes(row.numpy()) != bytes(kvquant_pack_ref(k, v, params)[0].numpy())


@pytest.mark.parametrize("bits, starts_sequence", [(2, False), (4, True)])
def test_select_outliers_picks_the_codecs_outliers(bits: int, starts_sequence: bool) -> None:
    params = make_params(bits, 3, 64, 16)
    k, v = random_blocks(4, params.layout)
    k_index, v_index = select_outliers(k, v, params, starts_sequence=starts_sequence)
    packed = params.codec().encode_blocks(k.cpu(), v.cpu(), starts_sequence=starts_sequence)
    assert k_index.shape == (4, 3, params.layout.num_outliers) and params.layout.num_outliers > 0
    assert torch.equal(k_index.cpu(), packed.k_outlier_index) and torch.equal(v_index.cpu(), packed.v_outlier_index)


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
    starts_sequence = bits == 3  # token 0 kept out of the outliers: the torch side's choice, the same kernel
    rows = kvquant_pack(k, v, params, KernelBackend.TRITON, starts_sequence=starts_sequence)
    expected = kvquant_pack_ref(k, v, params, starts_sequence=starts_sequence)
    assert rows.dtype == torch.uint8 and rows.shape == expected.shape
    assert torch.equal(rows, expected), f"{int((rows != expected).sum())} bytes differ"


@pytest.mark.usefixtures("triton_ready")
def test_pack_triton_rounds_ties_to_the_lower_entry_as_the_codec_does() -> None:
    bits, heads, tokens, dim = 3, 1, 16, 32
    codebook = torch.tensor([-1.0, -0.6, -0.3, -0.1, 0.0, 0.25, 0.5, 1.0])
    codec = KvQuantCodec(bits, torch.zeros(heads, dim), torch.ones(heads, dim), codebook, codebook.clone(), 0.01)
    tables = torch.zeros(2, tokens, dim // 2, device=DEVICE)
    params = KvQuantLayerParams.from_codec(codec, tokens, tables[0], tables[1])
    midpoints = (codebook[1:] + codebook[:-1]) / 2  # keys exactly on them normalise to them (centre 0, scale 1)
    k = midpoints[torch.arange(tokens * dim) % 7].view(1, heads, tokens, dim).to(DEVICE)
    v = torch.randn(1, heads, tokens, dim, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert torch.equal(kvquant_pack(k, v, params, KernelBackend.TRITON), kvquant_pack_ref(k, v, params))


def _bad_pack_calls() -> dict[str, Callable[[], object]]:
    params = make_params(3, 2, 32, 16)
    k, v = random_blocks(2, params.layout)
    k_index, v_index = select_outliers(k, v, params)

    def pack(**overrides: object) -> Callable[[], object]:
        args = {"k": k, "v": v, "k_outlier_index": k_index, "v_outlier_index": v_index, "params": params}
        return lambda: kvquant_pack_triton(**(args | overrides))  # type: ignore[arg-type]

    odd = make_params(3, 2, 24, 16)
    return {
        "v shape": pack(v=v[:, :1]),
        "int k": pack(k=k.int()),
        "index shape": pack(k_outlier_index=k_index[..., :-1]),
        "float index": pack(v_outlier_index=v_index.float()),
        "two devices": pack(k=k.to("meta")),
        "head_dim not a power of two": pack(k=k[..., :24], v=v[..., :24], params=odd),
    }


@pytest.mark.usefixtures("triton_ready")
@pytest.mark.parametrize("name", list(_bad_pack_calls()))
def test_pack_launcher_rejects_bad_arguments(name: str) -> None:
    with pytest.raises(ValueError):
        _bad_pack_calls()[name]()
