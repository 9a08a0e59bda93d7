"""The `tsukimi` command as a user runs it: exit codes, messages, and `generate --json` on the real model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def tsukimi(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "required"),
        (["generate"], "PROMPT"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--max-tokens", "0"], "positive"),
        (["generate", "hi", "--top-p", "0"], "top_p"),
        (["generate", "hi", "--dtype", "fp8"], "invalid choice"),
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "no model at"),
        (["bench", "engine", "--batch-sizes", "1,x"], "comma-separated"),
        (["bench", "engine", "--batch-sizes", "0"], "positive"),
        (["bench"], "required"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: list[str], message: str) -> None:
    result = tsukimi(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_help_explains_each_command() -> None:
    for args in (["--help"], ["generate", "--help"], ["chat", "--help"], ["bench", "engine", "--help"]):
        result = tsukimi(*args)
        assert result.returncode == 0 and "usage:" in result.stdout


@pytest.mark.slow
def test_generate_json_reports_the_completion() -> None:
    result = tsukimi("generate", "The capital of France is", "--max-tokens", "8", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["completion_tokens"] == 8 and report["finish_reason"] == "length"
    assert report["prompt_tokens"] == 5 and "Paris" in report["text"]
    assert report["ttft_s"] > 0 and report["decode_tok_s"] > 0


@pytest.mark.slow
def test_chat_answers_on_stdin_and_exits_on_eof() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shared", "chat", "--temperature", "0", "--max-tokens", "16"],
        input="What is the capital of France?\n", capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "model>" in result.stdout and "Paris" in result.stdout


@pytest.mark.slow
def test_bench_engine_json_has_the_documented_fields() -> None:
    result = tsukimi(
        "bench", "engine", "--batch-sizes", "2", "--prompt-len", "16", "--gen-len", "2", "--repeats", "1",
        "--skip-transformers", "--json",
    )
    assert result.returncode == 0, result.stderr
    [row] = json.loads(result.stdout)["results"]
    fields = {"batch_size", "dtype", "tsukimi_prefill_tok_s", "transformers_prefill_tok_s", "tsukimi_decode_tok_s",
              "transformers_decode_tok_s", "prefill_ratio", "decode_ratio", "roofline_decode_tok_s"}
    assert fields <= row.keys()
    assert row["batch_size"] == 2 and row["tsukimi_decode_tok_s"] > 0 and row["roofline_decode_tok_s"] > 0
    assert row["transformers_decode_tok_s"] is None and row["decode_ratio"] is None  # skipped, said so
