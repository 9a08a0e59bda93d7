"""`tsukimi eval kv`: the harness on a tiny random model (fp16 against itself is exact, a lossy codec is not, only the
evaluation span is read, compression is the codec's), the calibration lookup, bad input exiting 2, and short real-model
runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.kvcompress import bundled
from shared.kvcompress.calibration import KvCalibrationError
from shared.kvcompress.registry import get_codec
from shared.model.config import LlamaConfig
from shared.tools.cli.main import main
from shared.tools.eval.kv import evaluate_codec
from shared.tools.eval.text_spans import TextSpanError
from tests.cli.tiny_model import tiny_checkpoint

TINY = LlamaConfig(
    vocab_size=50, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
    rope_theta=10000.0, rms_norm_eps=1e-5, max_position=512, tie_word_embeddings=True,
)
PROSE = (
    "The river ran slowly past the old mill, where the miller's daughter kept the accounts in a green ledger. "
    "Every spring the water rose, and every autumn the farmers brought their grain, arguing about the price. "
)


def text_tokens(count: int, seed: int = 1) -> list[int]:
    return torch.randint(0, TINY.vocab_size, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the harness ---------------------------------------------------------------------------------------------------


def test_fp16_against_itself_is_exact() -> None:
    calls: list[tuple[int, int]] = []
    result = evaluate_codec(
        tiny_checkpoint(TINY), "fp16", None, text_tokens(400), 64, 2, 16, progress=lambda *a: calls.append(a)
    )
    assert calls == [(1, 2), (2, 2)]
    assert result["ppl"] == result["ppl_fp16"] and result["rel_ppl_increase"] == 0
    assert result["kl"] == 0 and result["top1_agreement"] == 1
    assert result["compression"] == 1 and result["bits_per_element"] == 16
    assert result["num_windows"] == 2 and result["num_predictions"] == 2 * 63
    assert 1 < result["ppl"] < 10 * TINY.vocab_size


def test_a_lossy_codec_moves_the_distribution_and_compresses_as_it_says() -> None:
    result = evaluate_codec(tiny_checkpoint(TINY), "kivi-2", None, text_tokens(400), 64, 2, 16)
    assert result["kl"] > 0 and result["ppl"] != result["ppl_fp16"]
    assert result["rel_ppl_increase"] == pytest.approx(result["ppl"] / result["ppl_fp16"] - 1)
    assert 0 <= result["top1_agreement"] <= 1
    codec, fp16 = get_codec("kivi-2"), get_codec("fp16")
    per_block = 2 * 4 * codec.num_bytes(2, 16, 64)  # 2 windows x 4 full blocks, per layer
    assert result["codec_bytes"] == TINY.num_layers * per_block
    assert result["compression"] == pytest.approx(fp16.num_bytes(2, 16, 64) / codec.num_bytes(2, 16, 64))
    assert result["bits_per_element"] == pytest.approx(codec.bits_per_element(2, 16, 64))


def test_only_the_evaluation_span_is_read() -> None:
    """The first 30% of the text is the calibration span: changing it changes nothing."""
    tokens = text_tokens(300)
    other = [7] * 90 + tokens[90:]  # int(300 * 0.3) = 90
    first = evaluate_codec(tiny_checkpoint(TINY), "kivi-2", None, tokens, 64, 3, 16)
    second = evaluate_codec(tiny_checkpoint(TINY), "kivi-2", None, other, 64, 3, 16)
    assert first == second and first["num_windows"] == 3
    changed = tokens[:200] + [7] * 100
    assert evaluate_codec(tiny_checkpoint(TINY), "kivi-2", None, changed, 64, 3, 16)["ppl"] != first["ppl"]


def test_windows_are_capped_by_the_span_and_bad_settings_raise() -> None:
    checkpoint = tiny_checkpoint(TINY)
    assert evaluate_codec(checkpoint, "int8", None, text_tokens(300), 100, 9, 16)["num_windows"] == 2
    with pytest.raises(TextSpanError):
        evaluate_codec(checkpoint, "int8", None, text_tokens(100), 100, 1, 16)
    with pytest.raises(ValueError, match="block size"):
        evaluate_codec(checkpoint, "int8", None, text_tokens(300), 8, 1, 16)
    with pytest.raises(KvCalibrationError):
        evaluate_codec(checkpoint, "kvquant-3", None, text_tokens(300), 64, 1, 16)
    with pytest.raises(ValueError, match="unknown KV codec"):
        evaluate_codec(checkpoint, "int3", None, text_tokens(300), 64, 1, 16)


# ---- the command ---------------------------------------------------------------------------------------------------


def tsukimi(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "prose.txt"
    path.write_text(PROSE * 12, encoding="utf-8")  # 517 tokens: two 128-token windows after the first 30%
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval"], "required"),
        (["eval", "kv", "--text", "x.txt"], "--codec"),
        (["eval", "kv", "--codec", "int3", "--text", "x.txt"], "invalid choice"),
        (["eval", "kv", "--codec", "int8", "--text", "x.txt", "--windows", "0"], "positive"),
        (["eval", "kv", "--codec", "int8", "--text", "x.txt", "--ctx", "32"], "below the block size"),
        (["eval", "kv", "--codec", "int8", "--text", "x.txt", "--kv-calib", "c.safetensors"], "takes no calibration"),
        (["eval", "kv", "--codec", "kvquant-2", "--text", "x.txt", "--kv-calib", "/nonexistent.safetensors"],
         "does not exist"),
        (["eval", "kv", "--codec", "kvquant-3", "--text", "x.txt", "--model", "/nonexistent"], "for the default model"),
        (["eval", "kv", "--codec", "int8", "--text", "x.txt", "--threads", "-1"], "threads"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: list[str], message: str) -> None:
    result = tsukimi(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def eval_kv_exit(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    """Run `tsukimi eval kv ...` in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "kv", *args])
    return exit_info.value.code, capsys.readouterr().err


def test_kvquant_without_a_calibration_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bundled, "CALIBRATION_DIR", tmp_path)  # nothing bundled
    code, stderr = eval_kv_exit(["--codec", "kvquant-4", "--text", "x.txt"], capsys)
    assert code == 2 and "tsukimi calibrate kv" in stderr and "--kv-calib" in stderr


def test_kvquant_uses_the_bundled_calibration_of_the_default_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bundled, "CALIBRATION_DIR", tmp_path)
    (tmp_path / "smollm2-135m-kvquant-3.safetensors").write_bytes(b"not a calibration")
    code, stderr = eval_kv_exit(["--codec", "kvquant-3", "--text", "x.txt"], capsys)
    assert code == 2 and "smollm2-135m-kvquant-3.safetensors is not a readable safetensors file" in stderr


def test_help_explains_eval_kv() -> None:
    result = tsukimi("eval", "kv", "--help")
    assert result.returncode == 0 and "usage:" in result.stdout and "--kv-calib" in result.stdout
    assert "eval" in tsukimi("--help").stdout


@pytest.mark.slow
def test_missing_text_exits_2() -> None:
    result = tsukimi("eval", "kv", "--codec", "int8", "--text", "/nonexistent/text.txt")
    assert result.returncode == 2 and "cannot read text file" in result.stderr


@pytest.mark.slow
def test_kivi_2_json_on_the_real_model(text_file: Path) -> None:
    result = tsukimi("eval", "kv", "--codec", "kivi-2", "--text", str(text_file), "--ctx", "128", "--windows", "1",
                     "--json")
    assert result.returncode == 0, result.stderr
    assert "window 1/1" in result.stderr
    report = json.loads(result.stdout)
    assert {"ppl", "ppl_fp16", "rel_ppl_increase", "kl", "top1_agreement", "compression"} <= report.keys()
    assert report["codec"] == "kivi-2" and report["num_windows"] == 1 and report["num_predictions"] == 127
    assert report["kl"] > 0 and 0 < report["top1_agreement"] <= 1 and report["ppl_fp16"] > 1
    assert report["rel_ppl_increase"] == pytest.approx(report["ppl"] / report["ppl_fp16"] - 1)
    assert report["bits_per_element"] == pytest.approx(2.75)  # head dim 64, 64-token blocks
    assert report["compression"] == pytest.approx(16 / 2.75)


@pytest.mark.slow
def test_fp16_table_on_the_real_model(text_file: Path) -> None:
    result = tsukimi("eval", "kv", "--codec", "fp16", "--text", str(text_file), "--ctx", "128", "--windows", "3")
    assert result.returncode == 0, result.stderr
    assert "holds only 2 of the 3 windows of 128 tokens" in result.stderr  # 517 tokens, 362 after the first 30%
    header, row = result.stdout.splitlines()[1:3]
    assert header.split() == ["codec", "ppl", "ppl", "fp16", "rel", "ppl", "KL", "top-1", "bits/elem", "compression"]
    cells = row.split()
    assert cells[0] == "fp16" and cells[1] == cells[2] and cells[3] == "+0.000%" and cells[4] == "0.00000"
    assert cells[5] == "100.00%" and cells[6] == "16.000" and cells[7] == "1.00x"
