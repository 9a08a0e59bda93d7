"""A request whose instance is lost is placed again (TSUKIMI_MIGRATION_LIMIT times at most): before its first token it
runs again, mid-answer the tokens the client has end its prompt and it goes on from the next; the client sees one
whole answer under its own id. Past the limit, or for a failure of the request itself, the failure reaches the
client."""

from __future__ import annotations

from typing import Any

import pytest
from gateway_fakes import MESSAGES, MODEL, FakeBackend, Script, serving, sse_payloads, token_events
from test_gateway_errors import assert_error

from services.gateway.app import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics, RequestTimer
from services.gateway.session import Deadlines, Session
from shared.wire.protocol import ErrorType, SamplingParams, StreamEvent, SubmitReply, SubmitRequest

CHAT = {"model": MODEL, "messages": MESSAGES}
LIMIT_2 = GatewayConfig(block_size=16, request_timeout_s=30.0, progress_timeout_s=5.0, migration_limit=2)
LOST = "decode instance decode-0 stopped responding"


def failing_first(num_failures: int, error_type: ErrorType = ErrorType.UNAVAILABLE, error: str = LOST,
                  after: list[str] | None = None) -> Script:
    """Its first `num_failures` placements fail (after the tokens `after`, if any), the next answers "Hello"."""
    calls = []

    def script(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        calls.append(request.request_id)
        reply = SubmitReply(request.request_id, True, "p0", "d0")
        if len(calls) > num_failures:
            return reply, token_events(request.request_id, ["Hel", "lo"])
        tokens = token_events(request.request_id, after or [], finish="")
        return reply, [*tokens, StreamEvent.failure(request.request_id, error_type, error)]

    return script


async def test_a_request_lost_before_its_first_token_is_placed_again(checkpoint: Any) -> None:
    backend = FakeBackend(failing_first(2))
    async with serving(checkpoint, backend, LIMIT_2) as (client, _):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status == 200
        payloads = sse_payloads(await resp.text())
        metrics = await (await client.get("/metrics")).text()
    first = backend.submits[0].request_id
    assert [s.request_id for s in backend.submits] == [first, f"{first}-r1", f"{first}-r2"]
    assert [s.prompt_ids for s in backend.submits[1:]] == [backend.submits[0].prompt_ids] * 2
    assert [s.num_placed_before for s in backend.submits] == [0, 1, 2]  # the scheduler does not judge it again
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads[:-1]) == "Hello"
    assert {p["id"] for p in payloads[:-1]} == {f"chatcmpl-{first}"}  # the client's id, whatever the placement
    assert backend.cancels == [(first, "placed again"), (f"{first}-r1", "placed again")]
    assert not backend.open_streams  # every placement's stream closed
    assert 'tsukimi_gateway_requests_placed_again_total{stage="before_first_token"} 2' in metrics


async def test_past_the_limit_the_loss_reaches_the_client(checkpoint: Any) -> None:
    backend = FakeBackend(failing_first(3))
    async with serving(checkpoint, backend, LIMIT_2) as (client, _):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 503 and resp.headers["Retry-After"]
        body = await resp.json()
    assert_error(body, code="unavailable")
    assert LOST in body["error"]["message"] and len(backend.submits) == 3


async def test_a_prompt_kv_lost_on_the_way_is_placed_again(checkpoint: Any) -> None:
    backend = FakeBackend(failing_first(1, ErrorType.KV_TRANSFER, "KV chunk 3 of 9 never arrived"))
    async with serving(checkpoint, backend, LIMIT_2) as (client, _):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 200 and (await resp.json())["choices"][0]["message"]["content"] == "Hello"
    assert len(backend.submits) == 2


async def test_a_failure_of_the_request_itself_is_not_placed_again(checkpoint: Any) -> None:
    backend = FakeBackend(failing_first(1, ErrorType.INVALID, "the prompt does not fit"))
    async with serving(checkpoint, backend, LIMIT_2) as (client, _):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 400
    assert len(backend.submits) == 1


async def test_a_placement_refused_now_answers_the_client_with_the_refusal(checkpoint: Any) -> None:
    lost_once = failing_first(1)

    def then_refused(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        if request.request_id.endswith("-r1"):
            return SubmitReply(request.request_id, False, error_type=ErrorType.REJECTED, reason="overloaded",
                               retry_after_s=2.0, reason_code="ttft_slo"), []
        return lost_once(request)

    backend = FakeBackend(then_refused)
    async with serving(checkpoint, backend, LIMIT_2) as (client, _):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 429 and resp.headers["Retry-After"] == "2"
    assert len(backend.submits) == 2 and backend.cancels == [(backend.submits[0].request_id, "placed again")]


async def test_a_request_lost_mid_answer_goes_on_from_the_next_token(checkpoint: Any) -> None:
    """The tokens the client has end the prompt of the next placement, which asks for the rest; the client sees one
    answer, its usage counting its own prompt and every token it received."""
    backend = FakeBackend(failing_first(1, after=["He", "l"]))
    body = {**CHAT, "max_tokens": 9, "min_tokens": 4, "seed": 7, "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}}
    async with serving(checkpoint, backend, LIMIT_2) as (client, gateway):
        resp = await client.post("/v1/chat/completions", json=body)
        payloads = sse_payloads(await resp.text())
        metrics = await (await client.get("/metrics")).text()
    first, moved = backend.submits
    assert moved.request_id == f"{first.request_id}-r1" and moved.num_placed_before == 1
    assert moved.prompt_ids == [*first.prompt_ids, 1000, 1001]  # the two tokens the client has
    assert moved.block_hashes == gateway.prompts.hashes(moved.prompt_ids)
    assert (moved.sampling.max_tokens, moved.sampling.min_tokens, moved.sampling.output_offset) == (7, 2, 2)
    assert (moved.sampling.seed, moved.sampling.temperature) == (7, 0.8)
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads[:-1] if p["choices"])
    assert text == "HelHello"  # "He", "l", then the new placement's "Hel", "lo": nothing lost, nothing repeated
    usage = payloads[-2]["usage"]
    assert usage["prompt_tokens"] == len(first.prompt_ids) and usage["completion_tokens"] == 4
    assert 'tsukimi_gateway_requests_placed_again_total{stage="mid_answer"} 1' in metrics


async def test_without_block_hashes_a_request_mid_answer_is_not_moved(checkpoint: Any) -> None:
    backend = FakeBackend(failing_first(1, after=["Hi"]))
    request = SubmitRequest("r", [1, 2, 3], [], SamplingParams(max_tokens=8), 0.0)
    session = Session(backend, request, Deadlines(), RequestTimer(GatewayMetrics(), 0.0), migration_limit=3)
    async with session:
        assert (await session.next_delta()).text == "Hi"
        with pytest.raises(ApiError) as failed:
            await session.next_delta()
    assert failed.value.status == 503 and len(backend.submits) == 1
