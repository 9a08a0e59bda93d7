"""A decoder layer's small ops: RMSNorm with the residual add before it, rotary position embedding, SwiGLU's
silu(gate) * up.

Each has a plain PyTorch reference (`*_ref`, the model's arithmetic and the C++ ops' oracle) and the C++ CPU op
(`kernels/csrc/layer_ops.cpp`: one pass instead of four to six ops, whose dispatch is most of their cost at a decode
step's few rows). `LayerOps` is the set a model runs with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels.cpu_build import cpu_kernels_error


class AddRmsNorm(Protocol):
    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class ApplyRotary(Protocol):
    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


class SiluAndMul(Protocol):
    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * RMSNorm(s), s) for s = x + residual (or x): normalised in fp32, as the reference model does, then
    returned to the model dtype. x, residual: [rows, hidden]."""
    total = x if residual is None else x + residual
    normed = F.rms_norm(total.float(), (total.shape[-1],), eps=eps)
    return weight * normed.to(total.dtype), total


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] rotated by position (rotate-half convention); cos, sin: [num_tokens, 1,
    head_dim] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up]: [rows, 2 * width] -> [rows, width]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # silu writes a fresh tensor; multiplied in place


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref` in one C++ pass (rows of x and residual contiguous)."""
    normed, total = torch.ops.tsukimi_cpu.add_rms_norm(x, residual, weight, float(eps))
    return normed, (x if residual is None else total)


def apply_rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_ref` in one C++ pass; x may be a strided view (each head's values contiguous)."""
    result: torch.Tensor = torch.ops.tsukimi_cpu.apply_rotary(x, cos.contiguous(), sin.contiguous())
    return result


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_ref` in one C++ pass."""
    result: torch.Tensor = torch.ops.tsukimi_cpu.silu_and_mul(gate_up)
    return result


@dataclass(frozen=True)
class LayerOps:
    """The implementations a model's layers call."""

    add_rms_norm: AddRmsNorm
    apply_rotary: ApplyRotary
    silu_and_mul: SiluAndMul


REFERENCE_OPS = LayerOps(add_rms_norm_ref, apply_rotary_ref, silu_and_mul_ref)
CPU_OPS = LayerOps(add_rms_norm_cpu, apply_rotary_cpu, silu_and_mul_cpu)


def cpu_layer_ops() -> LayerOps:
    """The C++ ops; RuntimeError (why) where they did not build."""
    error = cpu_kernels_error()
    if error is not None:
        raise RuntimeError(error)
    return CPU_OPS
