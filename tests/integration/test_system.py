"""The whole system, all real: `tsukimi up` with 2 prefill and 2 decode instances, a cache-store, the scheduler and
the gateway as processes around a real nats-server, serving SmolLM2 over HTTP to raw clients and the openai client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from shared.wire.bus import Bus
from shared.wire.protocol import Heartbeat, Subjects, decode
from tests.integration.system_fixture import System, start_system, stop_system

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
LONG_TEXT = (Path(__file__).parent.parent.parent / "README.md").read_text()[:2500]
OTHER_TEXT = (Path(__file__).parent.parent.parent / "ARCHITECTURE.md").read_text()[:4000]  # fits a 64 MiB pool


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("system"))
    yield running
    pids = running.service_pids()
    code, took = stop_system(running)
    # Ctrl-C stops everything within 10 s, cleanly, leaving no process behind.
    assert code == 0, running.stdout_path.read_text()
    assert took < 10.0
    time.sleep(0.2)
    assert not [pid for pid in pids.values() if Path(f"/proc/{pid}").exists()
                and (Path(f"/proc/{pid}") / "stat").read_text().split()[2] != "Z"]


def _chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def test_non_streaming_chat(system: System) -> None:
    status, headers, body = system.post("/v1/chat/completions", _chat("Say hello.", max_tokens=8),
                                        {"X-Request-Id": "itest-plain-1"})
    assert status == 200, body
    assert headers["X-Request-Id"] == "itest-plain-1"
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 8 and usage["total_tokens"] == usage["prompt_tokens"] + usage[
        "completion_tokens"]
    # Every service that touched the request logged it under its id (JSON lines).
    logged = {p.stem for p in system.log_dir.glob("*.log") if "itest-plain-1" in p.read_text()}
    assert {"gateway-0", "scheduler-0"} <= logged
    assert any(s.startswith("prefill-") for s in logged) and any(s.startswith("decode-") for s in logged)
    line = next(ln for ln in (system.log_dir / "scheduler-0.log").read_text().splitlines() if "itest-plain-1" in ln)
    assert json.loads(line)["request_id"].startswith("itest-plain-1-")  # the gateway's own id, the label in it


async def test_streaming_chat_over_raw_sse(system: System) -> None:
    body = _chat("Count to five.", max_tokens=10, stream=True, stream_options={"include_usage": True})
    async with aiohttp.ClientSession() as session, session.post(
        system.base_url + "/v1/chat/completions", json=body
    ) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        payloads = [line[6:] async for line in _sse_lines(response)]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c for c in chunks if c["choices"]]
    assert [c["choices"][0]["finish_reason"] for c in content].count(None) == len(content) - 1
    assert content[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


async def _sse_lines(response: aiohttp.ClientResponse):  # noqa: ANN202
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line


async def test_the_openai_client_works_unmodified(system: System) -> None:
    client = openai.AsyncOpenAI(base_url=system.base_url + "/v1", api_key="unused")
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=6, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage is not None
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=6, temperature=0,
        stream=True,
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text == reply.choices[0].message.content  # greedy: streaming and not give the same answer
    completion = await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                                 temperature=0)
    assert completion.choices[0].text
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await client.close()


async def _watch(system: System, subjects: list[str]) -> tuple[Bus, list[str]]:
    bus = await Bus.connect(system.nats.url, "itest-watch", Subjects(), system.watcher)
    seen: list[str] = []

    async def on(msg) -> None:  # noqa: ANN001
        seen.append(msg.subject)

    for subject in subjects:
        await bus.client.subscribe(subject, cb=on)
    await bus.client.flush()
    return bus, seen


async def test_two_of_each_both_receive_work_and_a_repeated_prompt_is_reused(system: System) -> None:
    bus, seen = await _watch(system, ["tsukimi.prefill.*.run", "tsukimi.decode.*.run"])
    client = openai.AsyncOpenAI(base_url=system.base_url + "/v1", api_key="unused")

    async def ask(content: str) -> openai.types.chat.ChatCompletion:
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=5, temperature=0)

    def both_used() -> bool:
        return len({s for s in seen if ".prefill." in s}) == 2 and len({s for s in seen if ".decode." in s}) == 2

    # Waves of 4 concurrent requests until every instance has had work: the decode placement weighs each instance's
    # predicted step time, fitted online from this machine's timings, so one wave may all fit on one instance.
    for wave in range(4):
        await asyncio.gather(*(ask(f"Question number {4 * wave + i}: what is {i} plus {wave}?") for i in range(4)))
        if both_used():
            break
    assert both_used(), seen
    # A long prompt; then, while a long cold prompt keeps one instance busy, the same prompt again: the Conductor
    # sends the repeat to the idle instance, which reuses the prefix (from the cache-store when the busy one holds it)
    # instead of computing it.
    seen.clear()
    prompt = "Summarize this document in one sentence:\n" + LONG_TEXT
    first = await ask(prompt)
    assert len([s for s in seen if ".prefill." in s]) == 1
    await asyncio.sleep(2.0)  # the first run's blocks reach the cache-store off the critical path
    filler = asyncio.create_task(ask("Translate this into French:\n" + OTHER_TEXT))
    while len([s for s in seen if ".prefill." in s]) < 2:
        await asyncio.sleep(0.01)
    second = await ask(prompt)
    _, filler_prefill, repeat_prefill = [s for s in seen if ".prefill." in s]
    await filler
    assert first.usage.prompt_tokens > 400
    # Both idle and no cache hit, the filler goes where the prefill cost fitted online is lower: either instance.
    assert repeat_prefill != filler_prefill, "the repeat should avoid the busy instance"
    assert second.usage.prompt_tokens_details.cached_tokens > 0.5 * first.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content
    await client.close()
    await bus.drain()


async def test_a_disconnecting_client_shrinks_the_decode_batch(system: System) -> None:
    bus = await Bus.connect(system.nats.url, "itest-beats", Subjects(), system.watcher)
    running: dict[str, int] = {}

    async def on(msg) -> None:  # noqa: ANN001
        beat = decode(msg.data)
        if isinstance(beat, Heartbeat) and beat.role == "decode":
            running[beat.instance_id] = beat.num_running

    await bus.client.subscribe(Subjects().heartbeat_all, cb=on)
    body = _chat("Write a very long story.", max_tokens=1500, ignore_eos=True, stream=True)
    async with aiohttp.ClientSession() as session:
        response = await session.post(system.base_url + "/v1/chat/completions", json=body)
        lines = _sse_lines(response)
        for _ in range(5):
            await lines.__anext__()
        await asyncio.sleep(0.8)
        assert sum(running.values()) == 1
        response.close()  # the client goes away mid-stream
    for _ in range(50):
        await asyncio.sleep(0.2)
        if sum(running.values()) == 0:
            break
    assert sum(running.values()) == 0
    await bus.drain()


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"{not json", 400, None),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2_000_000}]}, 413, None),
])
def test_bad_input_gets_an_openai_error(system: System, body: object, status: int, param: str | None) -> None:
    got, _, answer = system.post("/v1/chat/completions", body)
    assert got == status
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    # ...and the system keeps serving.
    assert system.get("/health")[0] == 200


def test_a_killed_decode_instance_is_dropped_and_the_rest_keeps_serving(system: System) -> None:
    pids = system.service_pids()
    os.kill(pids["decode-1"], signal.SIGKILL)
    time.sleep(3.0)  # the scheduler forgets a silent instance within 3 s (instance timeout 2.5 s)
    for i in range(3):
        status, _, body = system.post("/v1/chat/completions", _chat(f"Hello {i}", max_tokens=3))
        assert status == 200, body
    assert "decode-1" in system.stdout_path.read_text()  # the supervisor reported the death (and restarts it)
