"""Directed rounding of fp32 to fp16: the stored scale of a quantized range must still cover every element it scales.

Shared by the uniform quantizers (`shared.kvcompress.quantize`) and the kvquant row format (`kernels.kvquant_format`).
"""

from __future__ import annotations

import torch


def fp16_round_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= each element of `x` (fp32)."""
    nearest = x.to(torch.float16)
    above = torch.nextafter(nearest, torch.full_like(nearest, float("inf")))
    return torch.where(nearest.float() < x, above, nearest)


def fp16_round_down(x: torch.Tensor) -> torch.Tensor:
    """The largest fp16 value <= each element of `x` (fp32)."""
    nearest = x.to(torch.float16)
    below = torch.nextafter(nearest, torch.full_like(nearest, float("-inf")))
    return torch.where(nearest.float() > x, below, nearest)
