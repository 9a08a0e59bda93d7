"""`tsukimi up`'s one-machine defaults: bf16 where the CPU computes bf16 (AMX, AVX-512 BF16), fp32 elsewhere, and
prompts of one step prefilled where they decode when the Conductor predicts it better; a shell's setting wins."""

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


def test_up_lets_prompts_of_one_step_be_prefilled_where_they_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """One machine: up to 512 tokens (not the 128 of a cluster), unless the shell says; a sim system keeps 128."""
    args = argparse.Namespace(engine="real", profile=None, kv_codec=None, kv_calib=None, kv_policy=None,
                              fastgen_threshold=None, insecure=False, colocated=0, policy=None)
    monkeypatch.delenv("TSUKIMI_LOCAL_PREFILL_TOKENS", raising=False)
    assert _deployment_env(args)["TSUKIMI_LOCAL_PREFILL_TOKENS"] == "512"
    assert "TSUKIMI_LOCAL_PREFILL_TOKENS" not in _deployment_env(argparse.Namespace(**{**vars(args), "engine": "sim"}))
    monkeypatch.setenv("TSUKIMI_LOCAL_PREFILL_TOKENS", "0")
    assert "TSUKIMI_LOCAL_PREFILL_TOKENS" not in _deployment_env(args)
