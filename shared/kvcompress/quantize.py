"""Uniform round-to-nearest quantizers (asymmetric b-bit, symmetric int8) with fp16 metadata, in plain torch.

Owns the arithmetic and its error guarantee; which axis a codec groups along and how it lays out bytes is the codec's.
"""

from __future__ import annotations

import torch

from kernels.fp16_rounding import fp16_round_down, fp16_round_up

_INT8_MAX = 127


def _check_finite(*metadata: torch.Tensor) -> None:
    if not all(bool(torch.isfinite(m).all()) for m in metadata):
        raise ValueError("cannot quantize: the input holds NaN, inf, or values beyond the fp16 range")


def quantize_asymmetric(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization over `dim`: x ~ minimum + code * scale, code in [0, 2**bits - 1].

    The minimum is rounded down and the scale up to fp16, so the stored grid covers [min, max] and every element is
    within scale / 2 of its decoded value (scale as stored). A constant group gets scale 0 and decodes to its minimum.

    Args:
        x: any float tensor.
        bits: code width, 1 to 8.
        dim: the axis each (minimum, scale) pair is shared along.
    Returns:
        codes (uint8, shape of x), minimum and scale (fp16, shape of x with `dim` of size 1).
    Raises:
        ValueError: a width outside 1..8, or non-finite values (or beyond the fp16 range).
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    levels = (1 << bits) - 1
    x32 = x.float()
    minimum = fp16_round_down(x32.amin(dim=dim, keepdim=True))
    scale = fp16_round_up((x32.amax(dim=dim, keepdim=True) - minimum.float()) / levels)
    _check_finite(minimum, scale)
    divisor = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = ((x32 - minimum.float()) / divisor).round_().clamp_(0, levels)
    return codes.to(torch.uint8), minimum, scale


def dequantize_asymmetric(codes: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 minimum + code * scale, broadcasting the metadata as `quantize_asymmetric` returns it."""
    return minimum.float() + codes.float() * scale.float()


def quantize_symmetric_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over `dim`: x ~ code * absmax / 127, code in [-127, 127].

    The group's absolute maximum is what is stored (rounded up to fp16), so an element equal to it decodes exactly
    and every element is within absmax / 254 of its decoded value.

    Returns:
        codes (int8, shape of x) and absmax (fp16, shape of x with `dim` of size 1).
    Raises:
        ValueError: non-finite values (or beyond the fp16 range).
    """
    x32 = x.float()
    absmax = fp16_round_up(x32.abs().amax(dim=dim, keepdim=True))
    _check_finite(absmax)
    divisor = torch.where(absmax > 0, absmax.float(), torch.ones_like(absmax, dtype=torch.float32))
    codes = (x32 * _INT8_MAX / divisor).round_().clamp_(-_INT8_MAX, _INT8_MAX)
    return codes.to(torch.int8), absmax


def dequantize_symmetric_int8(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """fp32 code * absmax / 127; multiplying first keeps code +-127 exact."""
    return codes.float() * absmax.float() / _INT8_MAX
