"""Every way a gateway request can fail: bad input, admission, missing scheduler, failure events, silence, and
clients that go away. Each answers with an OpenAI error object and leaves nothing subscribed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from gateway_fakes import MESSAGES, MODEL, FakeBackend, answering, serving, sse_payloads, token_events

from services.gateway.app import GatewayConfig
from shared.wire.protocol import StreamEvent, SubmitReply, SubmitRequest

CHAT = {"model": MODEL, "messages": MESSAGES}


def assert_error(body: dict[str, Any], param: str | None = None, code: str | None = None) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["param"] == param and body["error"]["code"] == code, body


BAD_CHAT: list[tuple[Any, str | None]] = [
    ([], None),  # not an object
    ({"model": MODEL}, "messages"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": "hi"}, "messages"),
    ({**CHAT, "messages": ["hi"]}, "messages[0]"),
    ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages[0].content[0].text"),
    ({"messages": MESSAGES}, "model"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": -3}, "max_tokens"),
    ({**CHAT, "max_tokens": "5"}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "max_tokens": 2.0}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "max_completion_tokens": 5, "max_tokens": ["5"]}, "max_tokens"),  # the newer name wins, both checked
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "temperature": True}, "temperature"),
    ({**CHAT, "temperature": -1}, "temperature"),
    ({**CHAT, "temperature": 10**400}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "top_k": -2}, "top_k"),
    ({**CHAT, "seed": 1.5}, "seed"),
    ({**CHAT, "seed": 2**64}, "seed"),
    ({**CHAT, "stop": 3}, "stop"),
    ({**CHAT, "stop": ""}, "stop"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "logprobs": True}, "logprobs"),
    ({**CHAT, "ignore_eos": "no"}, "ignore_eos"),
    ({**CHAT, "min_tokens": -1}, "min_tokens"),
    ({**CHAT, "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT)
async def test_bad_chat_requests_get_400_naming_the_field(checkpoint: Any, body: Any, param: str | None) -> None:
    backend = FakeBackend()
    async with serving(checkpoint, backend) as (client, _):
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 400, await resp.text()
        assert resp.headers["Content-Type"].startswith("application/json")
        assert_error(await resp.json(), param)
    assert not backend.submits


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"model": MODEL, "prompt": [1, "a"]}, "prompt"),
        ({"model": MODEL, "prompt": [1, True]}, "prompt"),
        ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ({"model": MODEL, "prompt": [10**9]}, "prompt"),
        ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
        ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
    ],
)
async def test_bad_completion_requests_get_400(checkpoint: Any, body: Any, param: str) -> None:
    async with serving(checkpoint, FakeBackend()) as (client, _):
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 400, await resp.text()
        assert_error(await resp.json(), param)


async def test_malformed_bodies_routes_methods_and_models_answer_json(checkpoint: Any) -> None:
    config = GatewayConfig(block_size=16, max_body_bytes=4096)
    async with serving(checkpoint, FakeBackend(), config) as (client, _):
        for data in (b"{", b"\xff\xfe", b"", b"null"):
            resp = await client.post("/v1/chat/completions", data=data)
            assert resp.status == 400
            assert_error(await resp.json())
        big = {"model": MODEL, "prompt": "x" * 5000}
        resp = await client.post("/v1/completions", json=big)
        assert resp.status == 413
        assert_error(await resp.json(), code="request_too_large")
        resp = await client.get("/v1/nothing")
        assert resp.status == 404
        assert_error(await resp.json(), code="not_found")
        resp = await client.get("/v1/chat/completions")
        assert resp.status == 405 and "POST" in resp.headers["Allow"]
        assert_error(await resp.json(), code="method_not_allowed")
        resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"})
        assert resp.status == 404
        assert_error(await resp.json(), "model", "model_not_found")


async def test_prompt_plus_max_tokens_must_fit_the_context(checkpoint: Any) -> None:
    backend = FakeBackend()
    num_prompt = len(checkpoint.tokenizer.encode_chat(MESSAGES))
    async with serving(checkpoint, backend, context_len=num_prompt + 10) as (client, _):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 11})
        assert resp.status == 400
        assert_error(await resp.json(), "max_tokens", "context_length_exceeded")
        assert (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10})).status == 200
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200  # default shrinks to fit
        long = {"model": MODEL, "prompt": list(range(1, num_prompt + 11))}
        resp = await client.post("/v1/completions", json=long)
        assert_error(await resp.json(), "prompt", "context_length_exceeded")
    assert [s.sampling.max_tokens for s in backend.submits] == [10, 10]


async def test_a_rejection_is_429_with_retry_after(checkpoint: Any) -> None:
    def reject(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        reply = SubmitReply(request.request_id, False, error_type="rejected", reason="TTFT SLO", retry_after_s=2.2,
                            reason_code="ttft_slo")
        return reply, []

    backend = FakeBackend(reject)
    async with serving(checkpoint, backend) as (client, _):
        for stream in (False, True):
            body = {**CHAT, "stream": stream, "slo_ttft_ms": 1500, "slo_tbt_ms": 80}
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 429 and resp.headers["Retry-After"] == "3"
            assert_error(await resp.json(), code="rate_limit_exceeded")
            assert (await resp.json())["error"]["message"] == "TTFT SLO"
        metrics = await (await client.get("/metrics")).text()
        assert 'tsukimi_gateway_rejections_total{reason="ttft_slo"} 2' in metrics
        bad = await client.post("/v1/chat/completions", json={**CHAT, "slo_ttft_ms": -5})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "slo_ttft_ms"
        tiny = await client.post("/v1/chat/completions", json={**CHAT, "slo_tbt_ms": 5e-324})  # 0 s once in seconds
        assert tiny.status == 400 and (await tiny.json())["error"]["param"] == "slo_tbt_ms"
    assert not backend.cancels and not backend.open_streams
    # The SLO extension fields reach the scheduler, in seconds.
    assert [(s.ttft_slo_s, s.tbt_slo_s) for s in backend.submits] == [(1.5, 0.08), (1.5, 0.08)]


async def test_no_scheduler_or_no_instances_is_503(checkpoint: Any) -> None:
    def unavailable(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        return SubmitReply(request.request_id, False, error_type="unavailable", reason="no decode instance"), []

    backend = FakeBackend(is_scheduler_down=True)
    async with serving(checkpoint, backend) as (client, gateway):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 503
        assert_error(await resp.json(), code="unavailable")
        backend.is_scheduler_down, backend.script = False, unavailable
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status == 503
        assert (await resp.json())["error"]["message"] == "no decode instance"
        assert not gateway.active_request_ids
    # The scheduler may have placed the request whose answer got lost: it is cancelled to be sure.
    assert [reason for _, reason in backend.cancels] == ["gateway gave up on the request"]
    assert not backend.open_streams


async def test_a_submission_waits_for_a_restarting_scheduler(checkpoint: Any) -> None:
    """No scheduler answers for a moment (its supervisor restarts it): the request is submitted again until one does,
    within TSUKIMI_SCHEDULER_WAIT_S; past it, 503."""
    backend = FakeBackend(is_scheduler_down=True)
    waiting = GatewayConfig(block_size=16, scheduler_wait_s=5.0)
    async with serving(checkpoint, backend, waiting) as (client, _):
        asyncio.get_running_loop().call_later(0.4, setattr, backend, "is_scheduler_down", False)
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 200, await resp.text()
    assert len(backend.submits) >= 3 and len({s.request_id for s in backend.submits}) == 1
    backend = FakeBackend(is_scheduler_down=True)
    async with serving(checkpoint, backend, GatewayConfig(block_size=16, scheduler_wait_s=0.3)) as (client, _):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 503 and "not answering" in (await resp.json())["error"]["message"]
    assert len(backend.submits) >= 2


@pytest.mark.parametrize(("error_type", "status"), [("kv_transfer", 502), ("unavailable", 503), ("internal", 500)])
async def test_a_failure_event_maps_to_a_status(checkpoint: Any, error_type: str, status: int) -> None:
    def fail(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        return SubmitReply(request.request_id, True), [StreamEvent(request.request_id, 0, [], "", None,
                                                                   error_type=error_type, error="it broke")]

    backend = FakeBackend(fail)
    async with serving(checkpoint, backend) as (client, _):
        for stream in (False, True):  # before any output, a stream can still answer with a status
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert resp.status == status
            assert (await resp.json())["error"]["message"] == "it broke"
    assert not backend.open_streams


async def test_a_failure_mid_stream_is_an_sse_error_then_done(checkpoint: Any) -> None:
    def fail_late(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        events = token_events(request.request_id, ["a", "b", "c"])[:2]
        return SubmitReply(request.request_id, True), [
            *events, StreamEvent(request.request_id, 2, [], "", error_type="kv_transfer", error="chunk 3 missing"),
        ]

    backend = FakeBackend(fail_late)
    never_moved = GatewayConfig(block_size=16, migration_limit=0)  # else it moves (test_gateway_placed_again.py)
    async with serving(checkpoint, backend, never_moved) as (client, _):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status == 200
        payloads = sse_payloads(await resp.text())
    assert payloads[-1] == "[DONE]"
    assert [p["choices"][0]["delta"].get("content") for p in payloads[:3]] == ["", "a", "b"]
    assert_error(payloads[3], code="kv_transfer")
    assert len(payloads) == 5 and not backend.open_streams


async def test_silence_times_out_with_504_and_a_cancel(checkpoint: Any) -> None:
    def two_then_silence(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        return SubmitReply(request.request_id, True), token_events(request.request_id, ["a", "b", "c"])[:2]

    backend = FakeBackend(two_then_silence)
    config = GatewayConfig(block_size=16, request_timeout_s=0.2)
    async with serving(checkpoint, backend, config) as (client, gateway):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 504
        assert_error(await resp.json(), code="timeout")
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        payloads = sse_payloads(await resp.text())
        assert resp.status == 200 and payloads[-1] == "[DONE]"
        assert_error(payloads[-2], code="timeout")
        assert not gateway.active_request_ids
    assert [reason for _, reason in backend.cancels] == ["timeout", "timeout"]
    assert not backend.open_streams


async def test_a_client_that_disconnects_mid_stream_cancels_the_request(checkpoint: Any) -> None:
    backend = FakeBackend(answering([f"t{i}" for i in range(100)]), event_gap_s=0.05)
    async with serving(checkpoint, backend) as (client, gateway):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        first = await resp.content.readuntil(b"\n\n")
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["delta"]["role"] == "assistant"
        assert gateway.active_request_ids and backend.open_streams
        resp.close()  # drop the connection
        await _eventually(lambda: bool(backend.cancels) and not backend.open_streams)
        assert backend.cancels == [(resp.headers["X-Request-Id"], "client disconnected")]
        assert not gateway.active_request_ids
        metrics = await (await client.get("/metrics")).text()
        assert "tsukimi_gateway_requests_in_flight 0" in metrics.splitlines()


async def test_a_client_that_gives_up_on_a_whole_answer_cancels_it(checkpoint: Any) -> None:
    backend = FakeBackend(answering(["slow"] * 50), event_gap_s=0.1)
    async with serving(checkpoint, backend) as (client, gateway):
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await _eventually(lambda: bool(gateway.active_request_ids) and bool(backend.open_streams))
        pending.cancel()  # the client gives up while the answer is being made: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await pending
        await _eventually(lambda: bool(backend.cancels) and not backend.open_streams)
        assert backend.cancels[0][1] == "client disconnected" and not gateway.active_request_ids


async def test_a_label_in_flight_twice_is_two_requests(checkpoint: Any) -> None:
    backend = FakeBackend(answering(["a", "b"]), hold=asyncio.Event())
    headers = {"X-Request-Id": "same"}
    async with serving(checkpoint, backend) as (client, gateway):
        first = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=headers))
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=headers))
        await _eventually(lambda: len(gateway.active_request_ids) == 2)  # both in flight at once
        backend.hold.set()  # type: ignore[union-attr]
        second = await pending
        assert second.status == 200 and second.headers["X-Request-Id"] == "same"
        assert (await second.json())["choices"][0]["message"]["content"] == "ab"
        assert (await first).status == 200 and not gateway.active_request_ids
    assert len({s.request_id for s in backend.submits}) == 2 and not backend.cancels


async def _eventually(condition: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
