"""The C++ layer ops (kernels/csrc/layer_ops.cpp) against their PyTorch references: bit for bit in bf16 (they round
where the references round), within an ulp or two in fp32 and fp16 (fused multiply-adds, another order of sums)."""

from __future__ import annotations

import pytest
import torch

from kernels.layer_ops import (
    add_rms_norm_cpu,
    add_rms_norm_ref,
    apply_rotary_cpu,
    apply_rotary_ref,
    cpu_layer_ops,
    silu_and_mul_cpu,
    silu_and_mul_ref,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)


@pytest.fixture(autouse=True)
def _built() -> None:
    cpu_layer_ops()  # the machines of `make test` have g++ (test_cpu_kernels_build): a failed build fails here


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.bfloat16:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=2e-3 if actual.dtype == torch.float16 else 1e-5, atol=1e-5)


@DTYPES
@pytest.mark.parametrize("rows", [1, 3, 300], ids=lambda n: f"{n}-rows")  # 300: split across threads
@pytest.mark.parametrize("with_residual", [False, True], ids=["alone", "after-add"])
def test_add_rms_norm_matches_the_reference(dtype: torch.dtype, rows: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 579, generator=gen) * 3).to(dtype)  # an odd width: the vector loops' tails
    residual = torch.randn(rows, 579, generator=gen).to(dtype) if with_residual else None
    weight = (torch.rand(579, generator=gen) + 0.5).to(dtype)
    normed, total = add_rms_norm_cpu(x, residual, weight, 1e-5)
    expected_normed, expected_total = add_rms_norm_ref(x, residual, weight, 1e-5)
    assert_matches(normed, expected_normed)
    assert torch.equal(total, expected_total)
    if not with_residual:
        assert total is x  # nothing to add: the stream is x itself


@DTYPES
def test_apply_rotary_matches_the_reference_on_a_strided_view(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(37, 14, 64, generator=gen).to(dtype)
    qk = fused[:, 1:13]  # rows strided as a slice of the fused projection
    positions = torch.randn(37, 1, 64, generator=gen)
    cos, sin = positions.cos().to(dtype), positions.sin().to(dtype)
    assert_matches(apply_rotary_cpu(qk, cos, sin), apply_rotary_ref(qk, cos, sin))


@DTYPES
@pytest.mark.parametrize("rows", [1, 257], ids=lambda n: f"{n}-rows")
def test_silu_and_mul_matches_the_reference(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1539, generator=gen) * 6).to(dtype)  # silu's tails: large |gate| both ways
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # past exp's clamp on either side
    assert_matches(silu_and_mul_cpu(gate_up), silu_and_mul_ref(gate_up))


def test_layer_ops_refuse_what_does_not_fit() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="does not fit"):
        add_rms_norm_cpu(x, None, torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match="must match"):
        add_rms_norm_cpu(x, torch.randn(4, 9), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="even head_dim"):
        apply_rotary_cpu(torch.randn(2, 3, 5), torch.randn(2, 1, 5), torch.randn(2, 1, 5))
    with pytest.raises(RuntimeError, match="2 \\* width"):
        silu_and_mul_cpu(torch.randn(4, 7))
