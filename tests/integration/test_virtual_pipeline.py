"""Chunked pipeline parallelism on the virtual clock (issue 22, point 4): `python -m services.virtual --cpp-group 3`
runs the prefill service's own pipeline stages over the sim engine: a long prompt's chunks flow through three stages
of a third of the layers each, their hidden states crossing the modelled network, so its TTFT is a little over a
third of one instance's; the stages' log lines name the layers and chunks each computed, and each stage puts its
layers of the prompt's blocks into the cache-store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loadgen.metrics import ttft_s
from loadgen.record import RequestRecord

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
PROMPT_TOKENS = 32_768
HIDDEN_BYTES = 8192 * 2  # a token's row of Llama-3-70B's residual stream in bf16


def _run(tmp_path: Path, name: str, *args: str) -> tuple[list[RequestRecord], list[dict[str, Any]]]:
    out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    done = subprocess.run([sys.executable, "-m", "services.virtual", "--trace", str(tmp_path / "trace.jsonl"),
                           "--quiet", "--json", str(out), "--log-file", str(log), "--prefill", "3", "--decode", "1",
                           "--time-scale", "30", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [RequestRecord(**r) for r in result["records"]], lines


def test_three_stages_prefill_a_long_prompt_in_about_a_third_of_the_time(tmp_path: Path) -> None:
    half = PROMPT_TOKENS // 512 // 2  # blocks: the first half of each prompt is one shared prefix, the rest its own
    lines = [{"timestamp": i * 1000, "input_length": PROMPT_TOKENS, "output_length": 8,  # 30 s apart at scale 30
              "hash_ids": list(range(half)) + list(range((i + 1) * half, (i + 2) * half))} for i in range(4)]
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    whole, _ = _run(tmp_path, "whole")
    piped, log = _run(tmp_path, "piped", "--cpp-group", "3")
    assert all(r.is_completed and r.num_output_tokens == 8 for r in whole + piped)
    first_whole, first_piped = ttft_s(whole[0]), ttft_s(piped[0])  # the first prompt: nothing reused
    assert first_whole is not None and first_piped is not None
    assert 1 / 3 < first_piped / first_whole < 0.45  # the pipeline's fill and drain cost a little over a third
    for record in piped[1:]:  # half of each later prompt is a shared prefix: every stage's own cache holds it
        assert record.num_cached_tokens == PROMPT_TOKENS // 2
    done = [line for line in log if line["event"] == "pipeline stage done"]
    assert {line["layers"] for line in done} == {"layers 0-26 of 80", "layers 27-53 of 80"}
    first_stage = [line for line in done if line["request_id"] == "trace-0" and line["stage"] == 0]
    assert first_stage[0]["chunks"] == PROMPT_TOKENS // 2048
    assert first_stage[0]["rows_bytes"] == 0  # sizes alone travel: the network counts what they stand for
    assert first_stage[0]["rows_raw_bytes"] == PROMPT_TOKENS * HIDDEN_BYTES
    prefilled = [line for line in log if line["event"] == "prefilled" and line["request_id"] == "trace-0"]
    assert prefilled[0]["stage"] == 2 and prefilled[0]["layers"] == "layers 54-79 of 80"
    # Each stage put its layers of the prompt's full blocks into the cache-store, then of each later prompt the
    # half it computed.
    stored = [(line["request_id"], line["stage"], line["first_block"], line["blocks"]) for line in log
              if line["event"] == "pipeline blocks stored"]
    blocks = PROMPT_TOKENS // 512
    assert sorted(stored) == sorted([("trace-0", stage, 0, blocks) for stage in range(3)]
                                    + [(f"trace-{i}", stage, blocks // 2, blocks // 2)
                                       for i in range(1, 4) for stage in range(3)])


def test_stages_load_a_prefix_their_caches_lost_from_the_cache_store(tmp_path: Path) -> None:
    """Caches of 40k tokens: prompt 1 (another prefix) pushes prompt 0's prefix out of every stage's cache, so prompt
    2, which shares it, starts after it only because every stage loads its own layers of it from the cache-store."""
    half = PROMPT_TOKENS // 512 // 2
    prefixes = [0, 10_000, 0]  # the first block id of each prompt's prefix: prompts 0 and 2 share theirs
    lines = [{"timestamp": i * 1000, "input_length": PROMPT_TOKENS, "output_length": 8,
              "hash_ids": list(range(p, p + half)) + list(range((i + 1) * 100 + 20_000, (i + 1) * 100 + 20_000 + half))}
             for i, p in enumerate(prefixes)]
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    records, log = _run(tmp_path, "evicted", "--cpp-group", "3", "--env", "TSUKIMI_SIM_KV_TOKENS=40960")
    assert [r.num_cached_tokens for r in records] == [0, 0, PROMPT_TOKENS // 2]
    fetched = {line["instance"] for line in log
               if line["event"] == "prefix fetched from the cache-store" and line["request_id"] == "trace-2"}
    assert fetched == {"prefill-0", "prefill-1", "prefill-2"}
    assert not [line for line in log if line["event"] == "pipeline prompt failed"]
