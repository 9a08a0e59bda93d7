"""Faults and overload on the whole system, all real processes: a killed decode instance's request goes on elsewhere
from its next token, a killed prefill instance's is placed again, both answered as if nothing happened; a restarted
cache-store serves its SSD blocks again and the Conductor uses them; overload gets 429s before any work while the
accepted are served."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared.wire.bus import Bus
from shared.wire.protocol import Subjects
from tests.integration.system_fixture import System, start_system, stop_system

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).parent.parent.parent
TEXTS = [(ROOT / name).read_text() for name in ("README.md", "ARCHITECTURE.md", "docs/block-hash.md")]


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    tmp = tmp_path_factory.mktemp("faults")
    running = start_system(tmp, {
        # A tiny DRAM tier spills every block to SSD, so that a restarted store still has them.
        "TSUKIMI_CACHE_SSD_DIR": str(tmp / "ssd"), "TSUKIMI_CACHE_DRAM_MB": "8", "TSUKIMI_CACHE_SSD_ADMIT_SEEN": "1",
        "TSUKIMI_SLO_TTFT_MS": "60000", "TSUKIMI_REJECTION": "predicted", "TSUKIMI_REQUEST_TIMEOUT_S": "60",
    })
    yield running
    code, _ = stop_system(running)
    assert code == 0


def _chat(content: str, max_tokens: int = 4, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, **extra}


async def _post(session: aiohttp.ClientSession, system: System, body: dict[str, object]) -> tuple[int, dict, dict]:
    async with session.post(system.base_url + "/v1/chat/completions", json=body) as response:
        return response.status, dict(response.headers), await response.json()


async def _watch(system: System, subject: str) -> tuple[Bus, list[str]]:
    bus = await Bus.connect(system.nats.url, "itest-faults", Subjects(), system.watcher)
    seen: list[str] = []

    async def on(msg) -> None:  # noqa: ANN001
        seen.append(msg.subject.split(".")[2])  # tsukimi.<role>.<instance>.run (or .handoff)

    await bus.client.subscribe(subject, cb=on)
    await bus.client.flush()
    return bus, seen


def _wait_alive(system: System, instance_id: str, timeout_s: float = 60.0) -> None:
    """Until the supervisor's restart of `instance_id` is back in the scheduler's view (a new 'joined' line)."""
    log = system.log_dir / "scheduler-0.log"
    before = log.read_text().count(f'"instance_id": "{instance_id}", "role"')
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.read_text().count(f'"instance_id": "{instance_id}", "role"') > before:
            return
        time.sleep(0.2)
    raise AssertionError(f"{instance_id} did not come back")


async def test_overload_is_refused_early_and_the_accepted_are_served(system: System) -> None:
    """Twelve long prompts at once, each asking for a TTFT of three times what one such prompt takes alone (on
    whatever this machine is doing now): the Conductor accepts what it predicts it can serve in time (a few per
    prefill instance) and refuses the rest with 429 before any prefill work."""
    prompts = [f"Request {i}. Summarize:\n" + TEXTS[i % 2][i * 300 : i * 300 + 2400] for i in range(12)]
    async with aiohttp.ClientSession() as session:
        alone_started = time.monotonic()
        status, _, _ = await _post(session, system, _chat("Summarize:\n" + TEXTS[2][:2400], max_tokens=1))
        assert status == 200
        slo_ttft_ms = max(2000, round(3000 * (time.monotonic() - alone_started)))
        started = time.monotonic()
        answers = await asyncio.gather(*(_post(session, system, _chat(p, slo_ttft_ms=slo_ttft_ms)) for p in prompts))
    statuses = [status for status, _, _ in answers]
    assert 429 in statuses and 200 in statuses, statuses
    assert set(statuses) <= {200, 429}
    for status, headers, body in answers:
        if status == 429:
            assert int(headers["Retry-After"]) >= 1
            assert "time to first token" in body["error"]["message"] and body["error"]["code"] == "rate_limit_exceeded"
    metrics = (await asyncio.to_thread(system.get, "/metrics"))[1]
    assert f'tsukimi_gateway_rejections_total{{reason="ttft_slo"}} {statuses.count(429)}' in metrics
    print(f"overload at a TTFT SLO of {slo_ttft_ms} ms: {statuses.count(200)} accepted, {statuses.count(429)} "
          f"refused, all answered in {time.monotonic() - started:.1f} s")


async def test_a_killed_decodes_request_goes_on_elsewhere_from_the_next_token(system: System) -> None:
    """Killed mid-answer, the request moves: the tokens the client has end its prompt on another instance, and the
    stream goes on with no token lost or repeated: the answer an undisturbed run gives (greedy), its usage whole."""
    bus, decodes = await _watch(system, "tsukimi.decode.*.handoff")
    placed_again = _placed_again((await asyncio.to_thread(system.get, "/metrics"))[1], "mid_answer")
    body = _chat("Tell me a long story about the sea.", max_tokens=48, ignore_eos=True, stream=True,
                 stream_options={"include_usage": True})
    async with aiohttp.ClientSession() as session:
        async with session.post(system.base_url + "/v1/chat/completions", json=body) as response:
            lines = response.content.__aiter__()
            head = [(await lines.__anext__()).decode().strip() for _ in range(8)]  # a few tokens in
            while not decodes:  # the hand-off stream opened before the first token
                await asyncio.sleep(0.02)
            victim = decodes[-1]
            os.kill(system.service_pids()[victim], signal.SIGKILL)
            tail = [line.decode().strip() async for line in lines if line.strip()]
        await asyncio.to_thread(_wait_alive, system, victim)
        async with session.post(system.base_url + "/v1/chat/completions", json=body) as response:
            undisturbed = [line.decode().strip() async for line in response.content if line.strip()]
    moved = _answer([*head, *tail])
    assert moved == _answer(undisturbed) and moved[1] == 48, (moved, _answer(undisturbed))
    assert _placed_again((await asyncio.to_thread(system.get, "/metrics"))[1], "mid_answer") == placed_again + 1
    await bus.drain()


def _answer(sse_lines: list[str]) -> tuple[str, int]:
    """The streamed text and the usage's completion tokens; no error on the way."""
    payloads = [json.loads(line[6:]) for line in sse_lines if line.startswith("data: {")]
    assert not [p for p in payloads if "error" in p], payloads[-2:]
    text = "".join(c["delta"].get("content") or "" for p in payloads for c in p["choices"])
    return text, payloads[-1]["usage"]["completion_tokens"]


async def test_a_killed_prefills_request_is_placed_again_and_answered(system: System) -> None:
    """Lost before its first token, the request runs again elsewhere: the client sees only a longer TTFT, and the
    answer an undisturbed run gives."""
    bus, prefills = await _watch(system, "tsukimi.prefill.*.run")
    placed_again = _placed_again((await asyncio.to_thread(system.get, "/metrics"))[1], "before_first_token")
    async with aiohttp.ClientSession() as session:
        long_prompt = "Summarize all of this:\n" + TEXTS[1][:4000]  # ~1000 tokens: seconds of prefill
        doomed = asyncio.create_task(_post(session, system, _chat(long_prompt, max_tokens=8)))
        while not prefills:
            await asyncio.sleep(0.02)
        victim = prefills[0]
        await asyncio.sleep(0.5)  # mid-prefill (it takes seconds on this CPU)
        os.kill(system.service_pids()[victim], signal.SIGKILL)
        bystander = await _post(session, system, _chat("What is two plus two?"))
        status, _, answer = await doomed
        assert status == 200, answer
        assert bystander[0] == 200
        await asyncio.to_thread(_wait_alive, system, victim)
        undisturbed = await _post(session, system, _chat(long_prompt, max_tokens=8))
    assert answer["choices"][0]["message"] == undisturbed[2]["choices"][0]["message"]
    assert answer["usage"]["completion_tokens"] == 8
    metrics = (await asyncio.to_thread(system.get, "/metrics"))[1]
    assert _placed_again(metrics, "before_first_token") == placed_again + 1
    log = (system.log_dir / "gateway-0.log").read_text()
    assert f"{victim} stopped responding" in log and "placing the request again" in log
    await bus.drain()


def _placed_again(metrics: str, stage: str) -> int:
    prefix = f'tsukimi_gateway_requests_placed_again_total{{stage="{stage}"}} '
    line = next((line for line in metrics.splitlines() if line.startswith(prefix)), prefix + "0")
    return int(float(line.split()[-1]))


async def test_a_restarted_cache_store_serves_its_ssd_blocks_to_the_conductor(system: System) -> None:
    document = "Explain this text:\n" + TEXTS[0][3000:6000]
    async with aiohttp.ClientSession() as session:
        first = await _post(session, system, _chat(document))
        assert first[0] == 200
        await asyncio.sleep(2.0)  # its blocks reach the store, and through the tiny DRAM tier, the SSD
        os.kill(system.service_pids()["cache-store-0"], signal.SIGKILL)
        await asyncio.to_thread(_wait_alive, system, "cache-store-0")
        # Push the document out of both prefill instances' local caches with two other long prompts each.
        for i in range(4):
            evictor = _chat(f"Evictor {i}:\n" + TEXTS[1][i * 2500 : i * 2500 + 2800])
            assert (await _post(session, system, evictor))[0] == 200
        again = await _post(session, system, _chat(document))
    assert again[0] == 200
    assert again[2]["choices"][0]["message"]["content"] == first[2]["choices"][0]["message"]["content"]
    cached = again[2]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0.5 * again[2]["usage"]["prompt_tokens"]
    logs = [p.read_text() for p in system.log_dir.glob("prefill-*.log")]
    assert any("prefix fetched from the cache-store" in log for log in logs), "the prefix should come from the store"


async def test_a_killed_scheduler_is_back_with_the_block_index_and_fails_nothing_placed(system: System) -> None:
    """Its supervisor restarts it; the requests it had placed go on meanwhile, new ones wait for it (the gateway
    submits again for TSUKIMI_SCHEDULER_WAIT_S) or get 503 with Retry-After, and it learns the caches' blocks from
    their snapshots: it places a document cached before the kill where its prefix is (local or in the store)."""
    document = "Explain this text:\n" + TEXTS[0][6000:9000]
    async with aiohttp.ClientSession() as session:
        first = await _post(session, system, _chat(document))
        assert first[0] == 200
        await asyncio.sleep(2.0)  # its blocks reach the store
        for i in range(4):  # out of both prefill instances' local caches
            evictor = _chat(f"Evictor {i}:\n" + TEXTS[1][10_000 + i * 2500 : 10_000 + i * 2500 + 2800])
            assert (await _post(session, system, evictor))[0] == 200
        body = _chat("Tell me about the moon.", max_tokens=48, ignore_eos=True, stream=True,
                     stream_options={"include_usage": True})
        async with session.post(system.base_url + "/v1/chat/completions", json=body) as response:
            lines = response.content.__aiter__()
            head = [(await lines.__anext__()).decode().strip() for _ in range(3)]  # placed, decoding
            os.kill(system.service_pids()["scheduler-0"], signal.SIGKILL)
            killed_at = time.monotonic()
            refused = 0
            while True:  # new requests: held until a scheduler answers, or refused with Retry-After
                status, headers, _ = await _post(session, system, _chat("Say hi."))
                if status == 200:
                    break
                assert status == 503 and int(headers["Retry-After"]) >= 1, (status, headers)
                assert time.monotonic() - killed_at < 60, "no scheduler came back"
                refused += 1
                await asyncio.sleep(0.1)
            back_s = time.monotonic() - killed_at
            tail = [line.decode().strip() async for line in lines if line.strip()]
        assert _answer([*head, *tail])[1] == 48  # placed before the kill: untouched
        again = await _post(session, system, _chat(document))
    assert again[0] == 200
    usage = again[2]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0.5 * usage["prompt_tokens"]
    placed = [json.loads(line) for line in (system.log_dir / "scheduler-0.log").read_text().splitlines()
              if '"event": "placed"' in line and f'"prompt_tokens": {usage["prompt_tokens"]},' in line]
    assert placed[-1]["reused_blocks"] > 0, placed[-1]  # the restarted scheduler knew where the prefix was
    print(f"scheduler killed: answering again after {back_s:.1f} s, {refused} requests refused meanwhile")
