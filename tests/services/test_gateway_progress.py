"""No silence: a request with no stream event while no live instance's heartbeat lists it fails (503 before its
first token, an SSE error after) and is cancelled; one that an instance holds waits; an abort reaches the client."""

from __future__ import annotations

from typing import Any

from gateway_fakes import MESSAGES, MODEL, FakeBackend, serving, sse_payloads, token_events
from test_gateway_errors import assert_error

from services.gateway import session as session_module
from services.gateway.app import GatewayConfig
from services.gateway.progress import MAX_CHECK_S, ProgressWatch, Verdict
from services.gateway.session import Reorderer
from shared.wire.protocol import Heartbeat, StreamEvent, SubmitReply, SubmitRequest

CHAT = {"model": MODEL, "messages": MESSAGES}
QUICK = GatewayConfig(block_size=16, request_timeout_s=30.0, progress_timeout_s=0.3)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_watch_is_lost_without_events_or_a_holder_and_silent_after_the_request_timeout() -> None:
    clock = Clock()
    watch = ProgressWatch(progress_timeout_s=15.0, request_timeout_s=300.0, clock=clock)
    assert watch.verdict() is Verdict.WAIT and watch.wait_s() == MAX_CHECK_S
    clock.now += 14.0
    watch.saw_held()  # a heartbeat lists it: progress
    clock.now += 14.0
    assert watch.verdict() is Verdict.WAIT and watch.wait_s() == MAX_CHECK_S
    clock.now += 1.0
    assert watch.verdict() is Verdict.LOST and watch.wait_s() == 0.0
    watch.saw_event()
    for _ in range(30):  # held all along, but no event for the whole request timeout
        clock.now += 10.0
        watch.saw_held()
    assert watch.verdict() is Verdict.SILENT


def test_a_watch_checks_at_least_four_times_per_progress_timeout() -> None:
    clock = Clock()
    watch = ProgressWatch(progress_timeout_s=0.4, request_timeout_s=300.0, clock=clock)
    assert watch.wait_s() == 0.1
    clock.now += 0.35
    assert abs(watch.wait_s() - 0.05) < 1e-9  # never past the deadline


def _accepted(events: list[StreamEvent]) -> Any:
    def script(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        return SubmitReply(request.request_id, True, "p0", "d0"), [
            StreamEvent(request.request_id, e.index, e.token_ids, e.text, e.finish_reason) for e in events]
    return script


async def test_a_lost_request_fails_with_503_before_its_first_token_and_is_cancelled(checkpoint: Any) -> None:
    backend = FakeBackend(_accepted([]))  # accepted, then nothing: no event, no heartbeat lists it
    async with serving(checkpoint, backend, QUICK) as (client, gateway):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        body = await resp.json()
        assert_error(body, code="unavailable")
        assert "lost" in body["error"]["message"]
        assert not gateway.active_request_ids
    assert backend.cancels == [(backend.submits[0].request_id, "lost")]
    assert not backend.open_streams


async def test_a_request_lost_mid_stream_ends_with_an_sse_error(checkpoint: Any) -> None:
    backend = FakeBackend(_accepted(token_events("r", ["a", "b", "c"])[:2]))
    async with serving(checkpoint, backend, QUICK) as (client, _):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status == 200
        payloads = sse_payloads(await resp.text())
    assert payloads[-1] == "[DONE]"
    assert [p["choices"][0]["delta"].get("content") for p in payloads[:3]] == ["", "a", "b"]
    assert_error(payloads[3], code="unavailable")
    assert [reason for _, reason in backend.cancels] == ["lost"]


async def test_a_request_an_instance_holds_waits_past_the_progress_timeout(checkpoint: Any) -> None:
    backend = FakeBackend(event_gap_s=0.5)  # 1.5 s of silence in all, five progress timeouts

    def held(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        backend.beats.append(Heartbeat("decode-0", "decode", 1, 0.0, request_ids=["other", request.request_id]))
        return SubmitReply(request.request_id, True), token_events(request.request_id, ["x", "y", "z"])

    backend.script = held
    async with serving(checkpoint, backend, QUICK) as (client, _):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["choices"][0]["message"]["content"] == "xyz"
    assert not backend.cancels


async def test_a_request_its_instance_stops_listing_is_lost(checkpoint: Any) -> None:
    backend = FakeBackend(event_gap_s=1.0)

    def dropped_after_the_first(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        backend.beats.append(Heartbeat("decode-0", "decode", 1, 0.0, request_ids=[request.request_id]))
        return SubmitReply(request.request_id, True), token_events(request.request_id, ["x", "y", "z"])

    backend.script = dropped_after_the_first
    async with serving(checkpoint, backend, QUICK) as (client, _):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        first = await resp.content.readuntil(b"\n\n")  # the role chunk: the first token arrived
        assert first.startswith(b"data: ")
        backend.beats.clear()  # the instance restarted without a word
        payloads = sse_payloads(first.decode() + await resp.text())
    assert_error(payloads[-2], code="unavailable")
    assert [reason for _, reason in backend.cancels] == ["lost"]


async def test_an_abort_reaches_the_client_as_an_error(checkpoint: Any) -> None:
    aborted_at_once = _accepted([StreamEvent("r", 0, [], "", "abort")])
    aborted_late = _accepted([*token_events("r", ["a"], finish=""), StreamEvent("r", 1, [], "", "abort")])
    async with serving(checkpoint, FakeBackend(aborted_at_once)) as (client, _):
        for stream in (False, True):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert resp.status == 503
            assert_error(await resp.json(), code="unavailable")
    async with serving(checkpoint, FakeBackend(aborted_late)) as (client, _):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        payloads = sse_payloads(await resp.text())
        assert resp.status == 200 and payloads[-1] == "[DONE]"
        assert_error(payloads[-2], code="unavailable")
        assert "aborted" in payloads[-2]["error"]["message"]
        whole = await client.post("/v1/chat/completions", json=CHAT)
        assert whole.status == 503


def test_a_gap_is_timed_from_when_events_began_to_wait_for_it() -> None:
    clock = Clock()
    reorder = Reorderer(clock)
    event = token_events("r", ["a", "b", "c", "d"], finish="")
    assert reorder.push(event[0]) == [event[0]] and reorder.gap_s() == 0.0
    assert reorder.push(event[2]) == [] and reorder.gap_s() == 0.0  # index 1 is missing from now
    clock.now += 6.0
    assert reorder.gap_s() == 6.0
    assert reorder.push(event[3]) == [] and reorder.gap_s() == 6.0  # still waiting for the same one
    assert reorder.push(event[1]) == [event[1], event[2], event[3]] and reorder.gap_s() == 0.0


async def test_events_lost_in_transit_end_the_request_with_a_502(checkpoint: Any, monkeypatch: Any) -> None:
    """A NATS restart loses the event of token 1; tokens 2 and 3 arrive: the gap will never fill."""
    monkeypatch.setattr(session_module, "STREAM_GAP_S", 0.3)
    backend = FakeBackend()

    def with_a_hole(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        backend.beats.append(Heartbeat("decode-0", "decode", 1, 0.0, request_ids=[request.request_id]))
        events = token_events(request.request_id, ["a", "b", "c", "d"], finish="")
        return SubmitReply(request.request_id, True), [events[0], events[2], events[3]]

    backend.script = with_a_hole
    async with serving(checkpoint, backend, QUICK) as (client, _):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        payloads = sse_payloads(await resp.text())
    assert [p["choices"][0]["delta"].get("content") for p in payloads[:2]] == ["", "a"]
    assert_error(payloads[2], code="kv_transfer")
    assert "lost in transit" in payloads[2]["error"]["message"]
    assert [reason for _, reason in backend.cancels] == ["stream events lost"]
