"""Building the C++ CPU kernels: into the configured cache, once; without a working compiler the engine's `auto`
keeps the references and an explicit `cpu` says why. Each case runs in a fresh process (the build is cached per
process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kernels.cpu_build import cpu_has_avx512

AUTO = "auto: cpu" if cpu_has_avx512() else "auto: torch"  # auto takes the kernels where their fast paths run

PROBE = """
import torch
from kernels.backend import select_backend
cpu = torch.device("cpu")
print("auto:", select_backend("auto", cpu).value)
try:
    print("cpu:", select_backend("cpu", cpu).value)
except ValueError as exc:
    print("cpu refused:", exc)
"""


def _probe(cache: Path, **env: str) -> str:
    environment = {**os.environ, "TSUKIMI_KERNEL_CACHE": str(cache), **env}
    done = subprocess.run([sys.executable, "-c", PROBE], env=environment, capture_output=True, text=True,
                          timeout=300, check=True)
    return done.stdout


def test_the_kernels_build_once_into_the_cache(tmp_path: Path) -> None:
    assert _probe(tmp_path).splitlines() == [AUTO, "cpu: cpu"]
    (library,) = tmp_path.glob("tsukimi_cpu_*.so")
    built_at = library.stat().st_mtime_ns
    # A second process loads the same file; with the compiler gone it could not have built another.
    assert _probe(tmp_path, CXX="/bin/false").splitlines() == [AUTO, "cpu: cpu"]
    assert [p.name for p in tmp_path.iterdir()] == [library.name] and library.stat().st_mtime_ns == built_at


def test_a_failing_compiler_leaves_the_references_and_says_why(tmp_path: Path) -> None:
    lines = _probe(tmp_path, CXX="/bin/false").splitlines()
    assert lines[0] == "auto: torch"
    assert lines[1].startswith("cpu refused: kernel backend 'cpu' requested but the C++ CPU kernels are unavailable")
    assert "/bin/false failed" in lines[1]
    assert not list(tmp_path.glob("*.so"))  # nothing half-written is left to load
