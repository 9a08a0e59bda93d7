"""`tsukimi eval fastgen`: the harness on a tiny random model (T=1.0 is the full cache exactly, a low T keeps less
and the baselines hold FastGen's memory, only the evaluation span is read, the coded variants: exact with a block past
the window, coded with small blocks), bad input exiting 2, and short real-model runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.fastgen.policies import FastGenSettings
from shared.fastgen.token_classes import TokenClasses
from shared.kvcompress.kvquant import KvQuantCodec
from shared.model.config import LlamaConfig
from shared.tools.eval.fastgen import WindowSpec, evaluate_fastgen
from shared.tools.eval.fastgen_codecs import KvServing
from shared.tools.eval.text_spans import TextSpanError
from tests.cli.tiny_model import tiny_checkpoint

TINY = LlamaConfig(
    vocab_size=50, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    rope_theta=10000.0, rms_norm_eps=1e-5, max_position=256, tie_word_embeddings=True,
)
TINY_CLASSES = TokenClasses(special=torch.arange(50) == 0, punct=(torch.arange(50) >= 1) & (torch.arange(50) <= 5))
SPEC = WindowSpec(prompt_len=24, gen_len=8, num_windows=2)
FIGURES = {"ppl", "rel_ppl_increase", "kv_kept_fraction", "top1_agreement", "kl"}


def text_tokens(count: int, seed: int = 1) -> list[int]:
    return torch.randint(0, TINY.vocab_size, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def tiny_run(
    threshold: float, tokens: list[int] | None = None, spec: WindowSpec = SPEC, codec: KvServing | None = None
) -> dict[str, Any]:
    tokens = text_tokens(200) if tokens is None else tokens
    return evaluate_fastgen(
        tiny_checkpoint(TINY), tokens, FastGenSettings(threshold), spec, classes=TINY_CLASSES, codec=codec
    )


def tiny_serving(bits: int, block_size: int) -> KvServing:
    """kvquant-b for TINY in blocks of block_size: every key channel calibrated to [-1, 1], linear codebooks."""
    codebook = torch.linspace(-1, 1, 1 << bits)
    shape = (TINY.num_kv_heads, TINY.head_dim)
    return KvServing.of([KvQuantCodec(bits, torch.zeros(shape), torch.ones(shape), codebook, codebook.clone(), 0.0625)
                         for _ in range(TINY.num_layers)], block_size)


# ---- the harness ---------------------------------------------------------------------------------------------------


def test_threshold_one_is_the_full_cache() -> None:
    result = tiny_run(1.0)
    assert result["policy_histogram"] == {"full": 2 * TINY.num_layers * TINY.num_kv_heads}
    assert result["ppl"] == result["ppl_full"] and result["rel_ppl_increase"] == 0 and result["kl"] == 0
    assert result["top1_agreement"] == 1 and result["kv_kept_fraction"] == 1
    for figures in result["baselines"].values():
        assert figures["kv_kept_fraction"] == 1 and figures["ppl"] == result["ppl_full"]
    assert result["num_windows"] == 2 and result["num_predictions"] == 2 * SPEC.gen_len
    assert 1 < result["ppl_full"] < 10 * TINY.vocab_size


def test_a_low_threshold_evicts_and_the_baselines_hold_the_same_memory() -> None:
    result = tiny_run(0.5)
    assert sum(result["policy_histogram"].values()) == 2 * TINY.num_layers * TINY.num_kv_heads
    assert set(result["policy_histogram"]) <= set(FastGenSettings().labels())
    assert result["policy_histogram"].get("full", 0) < 2 * TINY.num_layers * TINY.num_kv_heads
    assert result["kv_kept_fraction"] < 1 and result["kl"] > 0
    assert result["rel_ppl_increase"] == pytest.approx(result["ppl"] / result["ppl_full"] - 1)
    assert result["kv_kept_fraction"] == pytest.approx(sum(result["layer_kv_kept_fraction"]) / TINY.num_layers)
    assert set(result["baselines"]) == {"streaming_llm", "h2o"}
    for figures in result["baselines"].values():
        assert FIGURES <= figures.keys() and 0 <= figures["top1_agreement"] <= 1
        # round(fraction x length) per head: within one key per head of FastGen's share at these lengths
        assert figures["kv_kept_fraction"] == pytest.approx(result["kv_kept_fraction"], abs=1 / SPEC.prompt_len)


def test_only_the_evaluation_span_is_read() -> None:
    tokens = text_tokens(200)
    first = tiny_run(0.8, tokens)
    second = tiny_run(0.8, [7] * 60 + tokens[60:])  # int(200 * 0.3) = 60
    assert {k: v for k, v in first.items() if not k.endswith("_s")} == {
        k: v for k, v in second.items() if not k.endswith("_s")
    }
    assert tiny_run(0.8, tokens[:120] + [7] * 80)["ppl_full"] != first["ppl_full"]


def ring_fraction(block_size: int, spec: WindowSpec = SPEC) -> float:
    """The newest W of each step's L tokens, averaged over a window's steps."""
    lengths = range(spec.prompt_len + 1, spec.prompt_len + spec.gen_len + 1)
    return sum(min(block_size, length) / length for length in lengths) / spec.gen_len


def test_a_block_past_the_window_serves_everything_exact_and_changes_nothing() -> None:
    plain = tiny_run(0.5)
    assert "codec" not in plain
    coded = tiny_run(0.5, codec=tiny_serving(2, SPEC.window_len))  # no full block, every position in the ring
    assert {k: v for k, v in coded.items() if k != "codec" and not k.endswith("_s")} == {
        k: v for k, v in plain.items() if not k.endswith("_s")
    }
    codec = coded["codec"]
    assert codec["full"] == {"ppl": plain["ppl_full"], "rel_ppl_increase": 0.0, "kv_kept_fraction": 1.0,
                             "top1_agreement": 1.0, "kl": 0.0}
    assert codec["fastgen"] == {name: plain[name] for name in FIGURES}
    # 2 fp16 value range + 1 fp16 outlier each + 16 2-bit codes each (4 bytes) + 1 outlier channel each
    assert codec["name"] == "kvquant-2" and codec["entry_bytes"] == 4 + 2 * 2 + 2 * 4 + 2
    assert codec["fp16_entry_bytes"] == 2 * 2 * TINY.head_dim and codec["block_size"] == SPEC.window_len
    # the records plus a ring holding the whole sequence
    assert codec["kv_bytes_fraction"] == pytest.approx(plain["kv_kept_fraction"] * 18 / 64 + 1)


def test_small_blocks_code_both_variants_each_its_own_way() -> None:
    plain = tiny_run(1.0)
    coded = tiny_run(1.0, codec=tiny_serving(2, 4))
    assert {k: v for k, v in coded.items() if k != "codec" and not k.endswith("_s")} == {
        k: v for k, v in plain.items() if not k.endswith("_s")
    }
    codec = coded["codec"]
    # T = 1 keeps everything, yet blocks and lanes (records coded from blocks, beside a ring) serve different K/V
    assert codec["full"]["kv_kept_fraction"] == codec["fastgen"]["kv_kept_fraction"] == 1
    assert codec["full"]["kl"] > 0 and codec["fastgen"]["kl"] > 0 and codec["fastgen"] != codec["full"]
    assert codec["kv_bytes_fraction"] == pytest.approx(18 / 64 + ring_fraction(4))


def test_more_bits_lose_less_and_coded_fastgen_keeps_what_fastgen_keeps() -> None:
    results = {bits: tiny_run(0.5, codec=tiny_serving(bits, 4)) for bits in (2, 4)}
    for name in ("full", "fastgen"):
        assert results[4]["codec"][name]["kl"] < results[2]["codec"][name]["kl"]
    for result in results.values():
        codec = result["codec"]
        # the coded heads rank heavy hitters on their own attention, so the kept share may differ by a key or two
        kept = codec["fastgen"]["kv_kept_fraction"]
        assert kept == pytest.approx(result["kv_kept_fraction"], abs=2 / SPEC.prompt_len)
        records = kept * codec["entry_bytes"] / codec["fp16_entry_bytes"]
        assert codec["kv_bytes_fraction"] == pytest.approx(records + ring_fraction(4))


def test_windows_are_capped_by_the_span_and_bad_lengths_raise() -> None:
    assert tiny_run(0.9, spec=WindowSpec(24, 8, 9))["num_windows"] == 4  # 140 tokens, 33 per window
    with pytest.raises(TextSpanError):
        tiny_run(0.9, text_tokens(40))
    with pytest.raises(ValueError, match="positions"):
        tiny_run(0.9, spec=WindowSpec(200, 100, 1))
    with pytest.raises(ValueError, match="profile"):
        evaluate_fastgen(tiny_checkpoint(TINY), text_tokens(200), FastGenSettings(profile_rows=25), SPEC,
                         classes=TINY_CLASSES)


# ---- the command ---------------------------------------------------------------------------------------------------


def tsukimi(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "fastgen"], "--text"),
        (["eval", "fastgen", "--text", "x.txt", "--threshold", "0"], "threshold"),
        (["eval", "fastgen", "--text", "x.txt", "--threshold", "1.5"], "threshold"),
        (["eval", "fastgen", "--text", "x.txt", "--threshold", "high"], "invalid float"),
        (["eval", "fastgen", "--text", "x.txt", "--r-local", "-0.1"], "r_local"),
        (["eval", "fastgen", "--text", "x.txt", "--r-frequent", "2"], "r_frequent"),
        (["eval", "fastgen", "--text", "x.txt", "--windows", "0"], "positive"),
        (["eval", "fastgen", "--text", "x.txt", "--gen-len", "0"], "positive"),
        (["eval", "fastgen", "--text", "x.txt", "--profile-rows", "600"], "exceeds --prompt-len 512"),
        (["eval", "fastgen", "--text", "x.txt", "--threads", "-1"], "threads"),
        (["eval", "fastgen", "--text", "x.txt", "--kv-codec", "kivi-4"], "invalid choice"),
        (["eval", "fastgen", "--text", "x.txt", "--kv-calib", "c.safetensors"], "--kv-calib needs --kv-codec"),
        (["eval", "fastgen", "--text", "x.txt", "--kv-block-size", "16"], "--kv-block-size needs --kv-codec"),
        (["eval", "fastgen", "--text", "x.txt", "--kv-codec", "kvquant-4", "--kv-block-size", "0"], "positive"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: list[str], message: str) -> None:
    result = tsukimi(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_help_explains_eval_fastgen() -> None:
    result = tsukimi("eval", "fastgen", "--help")
    assert result.returncode == 0 and "usage:" in result.stdout
    assert "--threshold" in result.stdout and "--profile-rows" in result.stdout and "H2O" in result.stdout
    assert "--kv-codec {kvquant-2,kvquant-3,kvquant-4}" in result.stdout and "--kv-calib" in result.stdout
    assert "--kv-block-size W" in result.stdout
    assert "fastgen" in tsukimi("eval", "--help").stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [(["--text", "/nonexistent/text.txt"], "cannot read text file"),
     (["--text", str(Path(__file__).parents[2] / "README.md"), "--prompt-len", "9000"], "positions")],
)
def test_bad_input_found_after_loading_exits_2(args: list[str], message: str) -> None:
    result = tsukimi("eval", "fastgen", *args)
    assert result.returncode == 2 and message in result.stderr


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    prose = (
        "The river ran slowly past the old mill, where the miller's daughter kept the accounts in a green ledger. "
        "Every spring the water rose, and every autumn the farmers brought their grain, arguing about the price. "
    )
    path = tmp_path / "prose.txt"
    path.write_text(prose * 12, encoding="utf-8")  # 517 tokens, 362 after the first 30%: four windows of 81
    return path


def real_run(text_file: Path, *args: str) -> dict[str, Any]:
    result = tsukimi("eval", "fastgen", "--text", str(text_file), "--prompt-len", "64", "--gen-len", "16",
                     "--windows", "1", "--threads", "1", "--json", *args)
    assert result.returncode == 0, result.stderr
    assert "window 1/1" in result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_json_on_the_real_model(text_file: Path) -> None:
    report = real_run(text_file, "--threshold", "0.9")
    assert {"ppl", "ppl_full", "rel_ppl_increase", "kv_kept_fraction", "top1_agreement", "kl", "policy_histogram",
            "baselines", "elapsed_s"} <= report.keys()
    assert report["num_windows"] == 1 and report["num_predictions"] == 16 and report["ppl_full"] > 1
    assert sum(report["policy_histogram"].values()) == 30 * 3  # layers x KV heads
    assert 0 < report["kv_kept_fraction"] < 1 and report["kl"] > 0 and 0 < report["top1_agreement"] <= 1
    assert set(report["baselines"]) == {"streaming_llm", "h2o"}
    for figures in report["baselines"].values():
        assert FIGURES <= figures.keys()
        assert figures["kv_kept_fraction"] == pytest.approx(report["kv_kept_fraction"], abs=0.02)


@pytest.mark.slow
def test_threshold_one_equals_the_full_cache_on_the_real_model(text_file: Path) -> None:
    report = real_run(text_file, "--threshold", "1.0")
    assert report["policy_histogram"] == {"full": 30 * 3}
    assert report["kv_kept_fraction"] == 1 and report["top1_agreement"] == 1
    assert report["rel_ppl_increase"] == 0 and report["kl"] == 0 and report["ppl"] == report["ppl_full"]


@pytest.mark.slow
def test_a_kv_codec_on_the_real_model(text_file: Path) -> None:
    report = real_run(text_file, "--threshold", "0.9", "--kv-codec", "kvquant-4")
    codec = report["codec"]
    assert codec["name"] == "kvquant-4" and codec["entry_bytes"] == 74 and codec["fp16_entry_bytes"] == 256
    assert codec["block_size"] == 64  # the prompt is one full block: the full cache reads it coded
    assert codec["full"]["kv_kept_fraction"] == 1 and codec["full"]["kl"] > 0
    assert codec["fastgen"]["kv_kept_fraction"] == pytest.approx(report["kv_kept_fraction"], abs=0.002)
    ring = ring_fraction(64, WindowSpec(64, 16))
    assert codec["kv_bytes_fraction"] == pytest.approx(codec["fastgen"]["kv_kept_fraction"] * 74 / 256 + ring)
    assert report["kl"] > 0 and FIGURES <= codec["fastgen"].keys()
