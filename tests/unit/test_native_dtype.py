"""`tsukimi up` runs bf16 where the CPU computes bf16 (AMX, AVX-512 BF16), fp32 elsewhere; a shell's TSUKIMI_DTYPE
wins."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from shared.engine.config import cpu_native_dtype
from shared.tools.cli.up import _deployment_env


@pytest.mark.parametrize(("flags", "dtype"), [
    ("fpu sse avx2 avx512f avx512_bf16", "bf16"),
    ("fpu avx2 amx_tile amx_bf16", "bf16"),
    ("fpu sse avx2 avx512f", "fp32"),
])
def test_the_cpus_flags_choose_the_dtype(flags: str, dtype: str, tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n")
    assert cpu_native_dtype(cpuinfo) == dtype
    assert cpu_native_dtype(tmp_path / "none") == "fp32"


def test_up_sets_it_unless_the_shell_did(monkeypatch: pytest.MonkeyPatch) -> None:
    args = argparse.Namespace(engine="real", profile=None, kv_codec=None, kv_calib=None, kv_policy=None,
                              fastgen_threshold=None, insecure=False, colocated=0, policy=None)
    monkeypatch.delenv("TSUKIMI_DTYPE", raising=False)
    assert _deployment_env(args)["TSUKIMI_DTYPE"] == cpu_native_dtype()
    monkeypatch.setenv("TSUKIMI_DTYPE", "fp32")
    assert "TSUKIMI_DTYPE" not in _deployment_env(args)
    assert "TSUKIMI_DTYPE" not in _deployment_env(argparse.Namespace(**{**vars(args), "engine": "sim"}))
