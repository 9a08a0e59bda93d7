"""The one switch between the kernels (Triton on GPUs, C++ on CPUs) and their plain PyTorch references.

`auto` takes Triton on CUDA when it imports, the C++ CPU kernels on an AVX-512 CPU when they build
(`kernels.cpu_build`), the references otherwise; `triton` on a CPU tensor runs only under TRITON_INTERPRET=1 (the
kernel tests do that). The CPU backend has a kernel for decode attention only (at head sizes 64 and 128); every
other op takes its reference there.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

import torch

from kernels.cpu_build import auto_cpu_kernels_error, cpu_kernels_error


class KernelBackend(StrEnum):
    TORCH = "torch"
    TRITON = "triton"
    CPU = "cpu"


def triton_available() -> bool:
    """Whether the `triton` package is importable (it is not needed on CPU)."""
    return importlib.util.find_spec("triton") is not None


def select_backend(requested: str, device: torch.device) -> KernelBackend:
    """Resolve `auto` | `torch` | `triton` | `cpu` for a device (`cpu` and `auto` on CPU build the C++ kernels on
    first use); raises ValueError for an unknown name, missing Triton, or C++ kernels requested that do not build
    or do not fit the device."""
    if requested == "auto":
        if device.type == "cuda":
            return KernelBackend.TRITON if triton_available() else KernelBackend.TORCH
        is_cpu = device.type == "cpu"
        return KernelBackend.CPU if is_cpu and auto_cpu_kernels_error() is None else KernelBackend.TORCH
    try:
        backend = KernelBackend(requested)
    except ValueError:
        raise ValueError(f"unknown kernel backend {requested!r}: choose auto, torch, triton or cpu") from None
    if backend is KernelBackend.TRITON and not triton_available():
        raise ValueError("kernel backend 'triton' requested but the triton package is not installed")
    if backend is KernelBackend.CPU:
        if device.type != "cpu":
            raise ValueError(f"kernel backend 'cpu' runs on the CPU, not on {device}")
        error = cpu_kernels_error()
        if error is not None:
            raise ValueError(f"kernel backend 'cpu' requested but {error}")
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
