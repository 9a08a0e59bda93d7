"""Chunked pipeline parallelism through the real services (issue 22): `tsukimi up --prefill 2 --cpp-group 2` with the
real model. A prompt of a few thousand tokens is computed by both prefill instances as two stages (layers 0-14 and
15-29), chunk after chunk, its KV reaching decode from both and each stage's layers of its blocks reaching the
cache-store, and the answer is one engine's; the scheduler knows the stages' caches; a short prompt runs whole on one
instance; each stage's log names the request and what it computed; a stage killed mid-prompt costs its request only a
second placement, and a request beside it is served."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.engine.engine import LLMEngine
from shared.env_vars import ENV_VARS
from shared.wire.protocol import SamplingParams
from tests.integration.system_fixture import System, start_system, stop_system

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
DOCS = Path(__file__).parents[2] / "docs"  # English prose that travels with the repository
MIN_TOKENS = 1024
STEP_TOKENS = 512  # prefill steps: a prompt of a few thousand tokens crosses the stages in several chunks


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("pipeline-system"), {
        "TSUKIMI_CPP_MIN_TOKENS": str(MIN_TOKENS), "TSUKIMI_CPP_KV_MB": "128", "TSUKIMI_KV_CACHE_MB": "256",
        "TSUKIMI_MAX_BATCHED_TOKENS": str(STEP_TOKENS),
    }, args=["--cpp-group", "2"])
    yield running
    stop_system(running)


def _text(num_chars: int, offset: int = 0) -> str:
    text = "\n".join(path.read_text(encoding="utf-8") for path in sorted(DOCS.glob("**/*.md")))
    assert len(text) >= offset + num_chars
    return text[offset : offset + num_chars]


def _complete(system: System, prompt: str, max_tokens: int) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    status, _, answer = system.post("/v1/completions", body)
    return status, answer


def _log_lines(system: System, instance: str, request_id: str) -> list[dict[str, Any]]:
    lines = (system.log_dir / f"{instance}.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{") and request_id in line]


def _wait_for_event(system: System, instance: str, request_id: str, event: str, timeout_s: float = 30.0
                    ) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [line for line in _log_lines(system, instance, request_id) if line["event"] == event]
        if found or time.monotonic() > deadline:
            assert found, f"{instance} logged no {event!r} for {request_id} within {timeout_s:.0f} s"
            return found[0]
        time.sleep(0.2)


def test_a_long_prompt_runs_on_both_stages_and_answers_as_one_engine(system: System, make_engine) -> None:
    prompt = _text(8_000)
    status, answer = _complete(system, prompt, 12)
    assert status == 200, answer
    engine: LLMEngine = make_engine(block_size=64, max_num_batched_tokens=STEP_TOKENS, kv_cache_bytes=256 << 20)
    ids = engine.tokenizer.encode(prompt)
    assert len(ids) > 2 * MIN_TOKENS
    (expected,) = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert answer["choices"][0]["text"] == expected.text
    request_id = answer["id"].removeprefix("cmpl-")
    first = {line["event"]: line for line in _log_lines(system, "prefill-0", request_id)}
    second = {line["event"]: line for line in _log_lines(system, "prefill-1", request_id)}
    assert first["pipeline stage done"]["layers"] == "layers 0-14 of 30"
    assert first["pipeline stage done"]["chunks"] == -(-len(ids) // STEP_TOKENS) == second["prefilled"]["chunks"]
    assert second["pipeline prompt"]["layers"] == "layers 15-29 of 30" and second["prefilled"]["stage"] == 1
    assert "prefilled" not in first  # the first stage ends no hand-off: the last one does
    (placed,) = [line for line in _log_lines(system, "scheduler-0", request_id) if line["event"] == "placed"]
    assert placed["prefill"] == "prefill-0" and placed["pipeline_stages"] == 2
    block_size = int(ENV_VARS["TSUKIMI_BLOCK_SIZE"].default)
    for instance in ("prefill-0", "prefill-1"):  # each stage's layers of the prompt's blocks, off the critical path
        stored = _wait_for_event(system, instance, request_id, "pipeline blocks stored")
        assert stored["first_block"] == 0 and stored["blocks"] == stored["of"] == len(ids) // block_size
    # The stages' prefix caches report into their instances' KV events under each stage's namespace: the scheduler
    # predicts the same prompt, grown, from the blocks the first stage holds.
    status, again = _complete(system, prompt + _text(1_000, offset=8_000), 4)
    assert status == 200, again
    (placed,) = [line for line in _log_lines(system, "scheduler-0", again["id"].removeprefix("cmpl-"))
                 if line["event"] == "placed"]
    assert placed["pipeline_stages"] == 2 and placed["reused_blocks"] >= len(ids) // block_size - 1


def test_a_short_prompt_runs_whole_on_one_instance(system: System) -> None:
    status, answer = _complete(system, _text(2000, offset=20_000), 6)
    assert status == 200, answer
    request_id = answer["id"].removeprefix("cmpl-")
    lines = _log_lines(system, "prefill-0", request_id) + _log_lines(system, "prefill-1", request_id)
    assert not any(line["event"] == "pipeline prompt" for line in lines)


def _count(system: System, event: str, *instances: str) -> int:
    return sum((system.log_dir / f"{i}.log").read_text().count(f'"event": "{event}"') for i in instances)


def _wait_for(condition, what: str, timeout_s: float = 120) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_stage_killed_mid_prompt_places_its_request_again_and_the_rest_is_served(system: System) -> None:
    """The long prompt is at the second stage when it dies: that request is placed again (the gateway's log names
    what happened) and answered; a short request prefilled just before, now decoding, is answered in full."""
    results: dict[str, tuple[int, dict[str, Any]]] = {}

    def ask(name: str, prompt: str, max_tokens: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(name, _complete(system, prompt, max_tokens)))
        thread.start()
        return thread

    joined = _count(system, "pipeline prompt", "prefill-1")
    long = ask("long", _text(12_000, offset=4_000), 8)
    _wait_for(lambda: _count(system, "pipeline prompt", "prefill-1") > joined, "the second stage never got it")
    prefilled = _count(system, "prefilled", "prefill-0", "prefill-1")
    short = ask("short", _text(1200, offset=30_000), 40)
    _wait_for(lambda: _count(system, "prefilled", "prefill-0", "prefill-1") > prefilled, "the short one never got "
              "its first token")
    assert "long" not in results  # still at the second stage
    os.kill(system.service_pids()["prefill-1"], signal.SIGKILL)
    long.join(timeout=180)
    short.join(timeout=180)
    status, answer = results["long"]
    assert status == 200 and answer["usage"]["completion_tokens"] == 8, answer
    moved = [line for line in (system.log_dir / "gateway-0.log").read_text().splitlines()
             if "placing the request again" in line]
    assert moved and "prefill-1" in moved[-1], moved
    status, answer = results["short"]
    assert status == 200 and answer["usage"]["completion_tokens"] == 40, answer
