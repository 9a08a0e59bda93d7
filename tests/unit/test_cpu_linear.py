"""oneDNN-packed linear layers: the same products as F.linear for any number of rows, swapped in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.model.cpu_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="this torch has no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_can_pack_says_whether_this_cpu_packs_the_dtype(dtype: torch.dtype) -> None:
    try:
        PackedLinear(torch.randn(8, 4).to(dtype))
        packs = True
    except RuntimeError:  # oneDNN: "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        packs = False
    assert can_pack(torch.device("cpu"), dtype) == packs


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_rows", [1, 7, 32, 300])
def test_packed_linear_equals_f_linear(dtype: torch.dtype, tol: float, num_rows: int) -> None:
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"this CPU has no oneDNN {dtype} path (the test above checks that can_pack says so)")
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 40, generator=gen).to(dtype)
    x = torch.randn(num_rows, 40, generator=gen).to(dtype)
    out = PackedLinear(weight)(x)
    assert out.dtype == dtype and out.shape == (num_rows, 96)
    torch.testing.assert_close(out.float(), F.linear(x, weight).float(), atol=tol, rtol=tol)


def test_pack_linears_swaps_bias_free_layers_only() -> None:
    model = nn.Sequential(nn.Linear(8, 4, bias=False), nn.ReLU(), nn.Sequential(nn.Linear(4, 4, bias=True)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(x)
        pack_linears(model)
        assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], nn.Linear)
        torch.testing.assert_close(model(x), expected)
