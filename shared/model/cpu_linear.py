"""Bias-free linear layers with weights pre-packed by oneDNN, for CPU inference.

Packing reorders a weight once into oneDNN's blocked layout (what torch.compile's freezing does on CPU); measured
here it halves decode-step matmul time against `F.linear` on the plain [out, in] layout. CUDA never uses it.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether this build of torch can pack weights of `dtype` for `device`: a CPU torch built with oneDNN, and for
    bf16 or fp16 a CPU with oneDNN's path for them (AVX-512 or AVX-NE-CONVERT; an AVX2-only CPU has none)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """y = x @ W^T with W held in oneDNN's packed layout; x: [num_tokens, in_features]."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # A batch-size hint only tunes the blocking; any number of rows works with any hint.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")


def pack_linears(model: nn.Module) -> None:
    """Replace every bias-free `nn.Linear` inside `model` by a `PackedLinear` of the same weight, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None:
                setattr(parent, name, PackedLinear(child.weight))
