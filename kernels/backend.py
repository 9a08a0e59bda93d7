"""The one switch between Triton kernels and their plain PyTorch references.

`auto` takes Triton on CUDA when it imports, the references elsewhere (CPU, CI); `triton` on a CPU tensor runs only
under TRITON_INTERPRET=1 (the kernel tests do that).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
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


def jit_into(namespace: dict[str, Any], functions: Sequence[Callable[..., Any]]) -> Any:
    """Import triton, bind `tl` in `namespace` and replace each function there by its jitted version (kernels call
    each other through their module's globals); returns the triton module, which the caller binds last: it marks
    the kernels ready. Kernel modules import triton only here, on their first launch.

    Raises:
        RuntimeError: triton is not installed.
    """
    try:
        triton_module = importlib.import_module("triton")
        namespace["tl"] = importlib.import_module("triton.language")
    except ImportError:
        raise RuntimeError("the triton package is not installed; use KernelBackend.TORCH") from None
    for function in functions:
        namespace[function.__name__] = triton_module.jit(function)
    return triton_module
