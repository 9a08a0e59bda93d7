"""KV codecs as a user meets them: `tsukimi calibrate kv` writes a calibration the engine loads, `generate
--kv-codec` answers, and bad codecs, calibrations and combinations exit 2 with a message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.kvcompress import load_calibration

PROSE = ("The river ran slowly past the old mill, where the miller's daughter kept the accounts in a green ledger. "
         "Every spring the water rose, and every autumn the farmers brought their grain to be weighed. ") * 30


def tsukimi(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--kv-codec", "kvquant-5"], "invalid choice"),
        (["generate", "hi", "--kv-codec", "kvquant-3", "--kv-calib", "/nonexistent.safetensors"], "does not exist"),
        (["generate", "hi", "--kv-codec", "kivi-2", "--kv-calib", "x.safetensors"], "takes no calibration"),
        (["up", "--engine", "sim", "--kv-codec", "kvquant-3"], "sim engine"),
        (["calibrate", "kv", "--bits", "5", "--text", "x", "--out", "y"], "invalid choice"),
        (["calibrate", "kv", "--bits", "3", "--text", "/nonexistent.txt", "--out", "y"], "cannot read text file"),
        (["calibrate", "kv", "--bits", "3", "--text", "README.md", "--out", "y", "--window", "100"], "multiple"),
    ],
)
def test_bad_codec_arguments_exit_2_with_a_message(args: list[str], message: str) -> None:
    result = tsukimi(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


@pytest.mark.slow
def test_calibrate_writes_what_generate_loads(tmp_path: Path) -> None:
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    out = tmp_path / "kvq3.safetensors"
    result = tsukimi("calibrate", "kv", "--bits", "3", "--text", str(text), "--out", str(out), "--tokens", "128",
                     "--window", "64")
    assert result.returncode == 0, result.stderr
    calibration = load_calibration(out)
    assert calibration.bits == 3 and calibration.num_layers == 30 and calibration.info["tokens"] == 128
    too_many = tsukimi("calibrate", "kv", "--bits", "3", "--text", str(text), "--out", str(out), "--tokens", "65536")
    assert too_many.returncode == 2 and "fewer than --tokens" in too_many.stderr
    answer = tsukimi("generate", "The capital of France is", "--max-tokens", "8", "--json", "--kv-codec",
                     "kvquant-3", "--kv-calib", str(out), "--block-size", "4")
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["completion_tokens"] == 8


@pytest.mark.slow
def test_generate_with_the_shipped_kvquant_calibration_answers() -> None:
    result = tsukimi("generate", "The capital of France is", "--max-tokens", "8", "--json", "--kv-codec", "kvquant-4",
                     "--block-size", "4")
    assert result.returncode == 0, result.stderr
    assert "Paris" in json.loads(result.stdout)["text"]
