"""Builds the C++ CPU kernels in `kernels/csrc/` once per machine and loads them as torch operators.

The library is compiled for the CPU it runs on (`-march=native`: AVX-512 where there is one) and cached under a name
that hashes the source, torch's version and the CPU's feature flags, so another CPU (or torch) builds its own and
concurrent processes share one build. Without a C++ compiler, or when the build fails, `cpu_kernels_error` says why
and the engine keeps the PyTorch references (`KernelBackend.TORCH`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch.utils import cpp_extension

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))  # every source is built, and every source and header named in the build's hash
HEADERS = sorted(CSRC.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20"]
BUILD_TIMEOUT_S = 300


def cache_dir() -> Path:
    """Where built libraries are kept: $TSUKIMI_KERNEL_CACHE (declared in shared.env_vars, read here because the
    kernels import nothing of shared/), else ~/.cache/tsukimi/kernels."""
    configured = os.environ.get("TSUKIMI_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "tsukimi" / "kernels"


@cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _library_name() -> str:
    digest = hashlib.sha256()
    for part in (torch.__version__, " ".join(FLAGS), _cpu_flags(), *(s.read_text() for s in SOURCES + HEADERS)):
        digest.update(part.encode())
    return f"tsukimi_cpu_{digest.hexdigest()[:16]}.so"


def _compile(target: Path) -> None:
    """g++ the sources into `target` (written under a temporary name, then renamed: readers never see half)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libraries = cpp_extension.library_paths()
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        command = [
            compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{path}" for path in cpp_extension.include_paths()), *(str(s) for s in SOURCES),
            "-o", str(partial), *(f"-L{path}" for path in libraries), "-lc10", "-ltorch_cpu",
            *(f"-Wl,-rpath,{path}" for path in libraries),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)


@cache
def cpu_kernels_error() -> str | None:
    """None once the kernels are loaded (built first if this machine has no build yet); otherwise why not."""
    target = cache_dir() / _library_name()
    try:
        if not target.exists():
            _compile(target)
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"the C++ CPU kernels are unavailable: {exc}"
    return None


def cpu_has_avx512() -> bool:
    """Whether this CPU has AVX-512, which the kernels' fast paths need."""
    return " avx512f " in f"{_cpu_flags()} "


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU has AVX-512 bf16 dot products (`vdpbf16ps`), which the prefill kernel is written in."""
    return " avx512_bf16 " in f"{_cpu_flags()} "


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 (Intel Xeon from Sapphire Rapids on), which oneDNN's matmuls and
    PyTorch's CPU flash attention use."""
    return " amx_bf16 " in f"{_cpu_flags()} "


def auto_cpu_kernels_error() -> str | None:
    """None when `auto` takes the kernels on this machine; otherwise why not. Without AVX-512 their portable loops
    are slower than the references, so they are not even built then."""
    if not cpu_has_avx512():
        return "this CPU has no AVX-512, which the C++ CPU kernels' fast paths need"
    return cpu_kernels_error()
