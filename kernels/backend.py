"""The one switch between Triton kernels and their plain PyTorch references.

`auto` takes Triton on CUDA when it imports, the references elsewhere (CPU, CI); `triton` on a CPU tensor runs only
under TRITON_INTERPRET=1 (the kernel tests do that).
"""

from __future__ import annotations

import importlib.util
from enum import StrEnum
from typing import Any

import torch


class KernelBackend(StrEnum):
    TORCH = "torch"
    TRITON = "triton"


def triton_available() -> bool:
    """Whether the `triton` package is importable (it is not needed on CPU)."""
    return importlib.util.find_spec("triton") is not None


def select_backend(requested: str, device: torch.device) -> KernelBackend:
    """Resolve `auto` | `torch` | `triton` for a device; raises ValueError for an unknown name or missing Triton."""
    if requested == "auto":
        is_cuda = device.type == "cuda"
        return KernelBackend.TRITON if is_cuda and triton_available() else KernelBackend.TORCH
    try:
        backend = KernelBackend(requested)
    except ValueError:
        raise ValueError(f"unknown kernel backend {requested!r}: choose auto, torch or triton") from None
    if backend is KernelBackend.TRITON and not triton_available():
        raise ValueError("kernel backend 'triton' requested but the triton package is not installed")
    return backend


def on_grid(kernel: Any, grid: tuple[int, ...]) -> Any:
    """A jitted kernel bound to its launch grid (Triton's `kernel[grid](...)`, which type checkers misread)."""
    return kernel[grid]
