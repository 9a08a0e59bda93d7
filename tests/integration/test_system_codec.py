"""The whole system with a KV codec (`TSUKIMI_KV_CODEC=kvquant-3`, real processes, real NATS): it answers, a repeated
prompt reuses cached blocks and answers alike each time it does, and /metrics shows KV stored, kept in the
cache-store and moved prefill -> decode at a fraction of the bytes raw fp32 KV takes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.gateway.kv_metrics import parse_kv_samples, total_for_role
from tests.integration.system_fixture import System, start_system, stop_system

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
LONG_TEXT = (Path(__file__).parent.parent.parent / "README.md").read_text()[:2500]
FP32_TOKEN_BYTES = 2 * 30 * 3 * 64 * 4  # K and V of one token over SmolLM2's 30 layers, 3 KV heads, head dim 64


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("codec-system"), {"TSUKIMI_KV_CODEC": "kvquant-3"})
    yield running
    code, _ = stop_system(running)
    assert code == 0, running.stdout_path.read_text()


def _metrics(system: System) -> dict[str, float]:
    status, text = system.get("/metrics")
    assert status == 200
    return parse_kv_samples(text)


def test_answers_reuse_cached_blocks_and_metrics_show_the_codec(system: System) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Summarize in one sentence:\n" + LONG_TEXT}],
            "max_tokens": 12, "temperature": 0}
    status, _, first = system.post("/v1/chat/completions", body)
    assert status == 200, first
    assert first["choices"][0]["message"]["content"].strip()
    time.sleep(1.5)  # the blocks reach the cache-store off the critical path; heartbeats carry the counters
    prompt_tokens = first["usage"]["prompt_tokens"]
    answers = []
    for _ in range(2):  # both read the same cached blocks, so both answer alike (a fresh prefill attends exactly)
        status, _, again = system.post("/v1/chat/completions", body)
        assert status == 200, again
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.5 * prompt_tokens
        answers.append(again["choices"][0]["message"]["content"])
    assert answers[0].strip() and answers[0] == answers[1]
    time.sleep(1.0)
    samples = _metrics(system)
    formats = {k for k in samples if k.startswith("tsukimi_kv_block_bytes{")}
    assert formats and all('format="kvquant-3:' in k for k in formats)
    moved_tokens = total_for_role(samples, "tsukimi_kv_moved_tokens_total", "decode")
    assert moved_tokens >= 2 * prompt_tokens
    # Whole blocks travel as kvquant-3 bytes (about 3.4 bits per element), only the partial last block in fp32.
    assert total_for_role(samples, "tsukimi_kv_moved_bytes_total", "decode") / moved_tokens < FP32_TOKEN_BYTES / 3
    stored_blocks = total_for_role(samples, "tsukimi_kv_store_dram_blocks", "cache-store")
    assert stored_blocks >= prompt_tokens // 64
    per_block = total_for_role(samples, "tsukimi_kv_store_dram_bytes", "cache-store") / stored_blocks
    assert per_block < 64 * FP32_TOKEN_BYTES / 8
    decode_capacity = total_for_role(samples, "tsukimi_kv_capacity_tokens", "decode") / 2
    assert decode_capacity > 8 * (64 << 20) // FP32_TOKEN_BYTES * 0.5  # far more than a raw fp32 pool's 1.4k
