"""The gateway's HTTP API against a fake backend: response shapes, SSE sequences, the official openai client,
request ids, health and metrics."""

from __future__ import annotations

import re
from typing import Any

import openai
import pytest
import structlog
from gateway_fakes import KV_CODEC, MESSAGES, MODEL, FakeBackend, answering, serving, sse_payloads, token_events

from services.gateway.openai_api import DEFAULT_MAX_TOKENS
from shared.wire.block_hash import block_hashes, make_namespace
from shared.wire.protocol import Heartbeat, StreamEvent, SubmitReply, SubmitRequest, is_valid_request_id


async def test_chat_answer_has_the_openai_shape_and_submits_the_templated_prompt(checkpoint: Any) -> None:
    backend = FakeBackend(answering(["Hello", ",", " world"], num_cached=16))
    async with serving(checkpoint, backend) as (client, gateway):
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "seed": 7})
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    prompt_ids = checkpoint.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    request_id = resp.headers["X-Request-Id"]
    assert body["id"] == f"chatcmpl-{request_id}"
    assert body["object"] == "chat.completion" and body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{
        "index": 0, "finish_reason": "stop", "logprobs": None,
        "message": {"role": "assistant", "content": "Hello, world", "refusal": None},
    }]
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids), "completion_tokens": 3, "total_tokens": len(prompt_ids) + 3,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    [submit] = backend.submits
    assert submit.request_id == request_id and submit.prompt_ids == prompt_ids
    assert submit.block_hashes == block_hashes(prompt_ids, 16, make_namespace(checkpoint.fingerprint, KV_CODEC))
    assert len(submit.block_hashes) == len(prompt_ids) // 16 > 0
    assert submit.sampling.seed == 7 and submit.sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert not backend.open_streams and not backend.cancels and not gateway.active_request_ids


async def test_completions_accept_text_or_token_ids(checkpoint: Any) -> None:
    backend = FakeBackend(answering([" there", "!"], finish="length"))
    async with serving(checkpoint, backend) as (client, _):
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        body = await resp.json()
        resp_ids = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2, 3]]})
        assert resp_ids.status == 200
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None, "text": " there!"}]
    assert body["usage"]["completion_tokens"] == 2
    assert backend.submits[0].prompt_ids == checkpoint.tokenizer.encode("Hi")
    assert backend.submits[0].sampling.max_tokens == 2
    assert backend.submits[1].prompt_ids == [1, 2, 3]


@pytest.mark.parametrize("include_usage", [False, True])
async def test_chat_stream_is_role_then_one_chunk_per_event_then_done(checkpoint: Any, include_usage: bool) -> None:
    backend = FakeBackend(answering(["Hel", "lo", "!"]))
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with serving(checkpoint, backend) as (client, _):
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        payloads = sse_payloads(await resp.text())
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    request_id = resp.headers["X-Request-Id"]
    assert all(c["id"] == f"chatcmpl-{request_id}" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(("usage" in c) == include_usage for c in chunks)
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks if c["choices"]]
    assert deltas == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Hel"}, None), ({"content": "lo"}, None), ({"content": "!"}, "stop"),
    ]
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert all(c["choices"] for c in chunks)


async def test_completion_stream_has_text_chunks_and_a_bare_finish(checkpoint: Any) -> None:
    def script(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        events = token_events(request.request_id, ["a", "b"], finish="")
        events.append(StreamEvent(request.request_id, 2, [], "", "length"))  # the finish carries no tokens
        return SubmitReply(request.request_id, True), events

    async with serving(checkpoint, FakeBackend(script)) as (client, _):
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
        payloads = sse_payloads(await resp.text())
    assert payloads[-1] == "[DONE]"
    choices = [p["choices"][0] for p in payloads[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads[:-1])
    assert [(c["text"], c["finish_reason"]) for c in choices] == [("a", None), ("b", None), ("", "length")]


async def test_out_of_order_events_are_streamed_in_index_order(checkpoint: Any) -> None:
    def script(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        events = token_events(request.request_id, ["one", " two", " three", " four"])
        return SubmitReply(request.request_id, True), [events[2], events[0], events[3], events[1], events[0]]

    async with serving(checkpoint, FakeBackend(script)) as (client, _):
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
        payloads = sse_payloads(await resp.text())
        whole = await (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).json()
    assert [p["choices"][0]["text"] for p in payloads[:-1]] == ["one", " two", " three", " four"]
    assert whole["choices"][0]["text"] == "one two three four" and whole["usage"]["completion_tokens"] == 4


async def test_the_official_openai_client_works_unmodified(checkpoint: Any) -> None:
    backend = FakeBackend(answering(["Hi", " there"], num_cached=4))
    async with serving(checkpoint, backend) as (client, _):
        api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
        chat = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == "Hi there" and chat.choices[0].finish_reason == "stop"
        assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
        assert chat.usage.prompt_tokens_details.cached_tokens == 4
        stream = await api.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True},  # type: ignore[arg-type]
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi there"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
        text = await api.completions.create(model=MODEL, prompt="Say", max_tokens=3)
        assert text.choices[0].text == "Hi there"
        text_stream = await api.completions.create(model=MODEL, prompt="Say", stream=True)
        assert "".join([c.choices[0].text async for c in text_stream]) == "Hi there"
        models = await api.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(openai.NotFoundError) as missing:
            await api.chat.completions.create(model="other", messages=MESSAGES)  # type: ignore[arg-type]
        assert missing.value.code == "model_not_found"
        await api.close()
    assert not backend.open_streams


async def test_request_id_is_a_label_echoed_while_the_gateway_gives_its_own_id(checkpoint: Any) -> None:
    backend = FakeBackend()
    chat = {"model": MODEL, "messages": MESSAGES}
    async with serving(checkpoint, backend) as (client, _):
        answers = []
        for _ in range(2):  # a retrying client sends the same label again: a new request each time
            resp = await client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "my-id_1"})
            assert resp.status == 200 and resp.headers["X-Request-Id"] == "my-id_1"
            answers.append(await resp.json())
        first, second = (s.request_id for s in backend.submits)
        assert re.fullmatch(r"my-id_1-[0-9a-f]{16}", first) and re.fullmatch(r"my-id_1-[0-9a-f]{16}", second)
        assert first != second and [a["id"] for a in answers] == [f"chatcmpl-{first}", f"chatcmpl-{second}"]
        unlabelled = await client.post("/v1/chat/completions", json=chat)
        generated = unlabelled.headers["X-Request-Id"]
        assert re.fullmatch(r"[0-9a-f]{32}", generated) and backend.submits[-1].request_id == generated
        assert (await unlabelled.json())["id"] == f"chatcmpl-{generated}"
        bad = await client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "a.b"})
        assert bad.status == 400 and "X-Request-Id" not in bad.headers
        assert "X-Request-Id" in (await bad.json())["error"]["message"]
        too_long = await client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "x" * 129})
        assert too_long.status == 400
        longest = await client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "y" * 128})
        assert longest.status == 200 and longest.headers["X-Request-Id"] == "y" * 128
        internal = backend.submits[-1].request_id  # the whole label and the gateway's suffix: a subject token still
        assert len(internal) == 128 + 17 and internal.startswith("y" * 128 + "-") and is_valid_request_id(internal)
        error = await client.post("/v1/completions", data=b"{", headers={"X-Request-Id": "err-1"})
        assert error.status == 400 and error.headers["X-Request-Id"] == "err-1"
        first_health = await client.get("/health")
        second_health = await client.get("/health")
        assert first_health.headers["X-Request-Id"] != second_health.headers["X-Request-Id"]
    assert len(backend.submits) == 4


async def test_health_needs_a_live_scheduler_prefill_and_decode_instance(checkpoint: Any) -> None:
    backend = FakeBackend(alive={"scheduler": 1, "prefill": 2, "decode": 1})
    async with serving(checkpoint, backend) as (client, _):
        ok = await client.get("/health")
        assert ok.status == 200 and await ok.json() == {"status": "ok", "scheduler": 1, "prefill": 2, "decode": 1}
        backend.alive["decode"] = 0
        down = await client.get("/health")
        assert down.status == 503 and down.headers["Retry-After"] == "1"
        assert await down.json() == {"status": "unavailable", "scheduler": 1, "prefill": 2, "decode": 0,
                                     "missing": ["decode"], "message": "no live decode instance"}
        backend.alive |= {"decode": 1, "scheduler": 0}  # instances without a scheduler serve nothing
        no_scheduler = await client.get("/health")
        assert no_scheduler.status == 503 and (await no_scheduler.json())["missing"] == ["scheduler"]
        live = await client.get("/live")
        assert live.status == 200
        models = await (await client.get("/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["id"] == MODEL


async def test_metrics_expose_latency_histograms_and_token_counts(checkpoint: Any) -> None:
    backend = FakeBackend(answering(["a", "b", "c"], num_cached=16), event_gap_s=0.01, waiting={"prefill": 3})
    async with serving(checkpoint, backend) as (client, _):
        chat = {"model": MODEL, "messages": MESSAGES, "stream": True}
        streamed = await client.post("/v1/chat/completions", json=chat)
        assert sse_payloads(await streamed.text())[-1] == "[DONE]"
        await client.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
        resp = await client.get("/metrics")
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    lines = set(text.splitlines())
    num_prompt = len(checkpoint.tokenizer.encode_chat(MESSAGES))
    for line in [
        "# TYPE tsukimi_gateway_time_to_first_token_seconds histogram",
        'tsukimi_gateway_time_to_first_token_seconds_bucket{le="+Inf"} 1',
        "tsukimi_gateway_time_to_first_token_seconds_count 1",
        "tsukimi_gateway_inter_token_latency_seconds_count 2",
        "tsukimi_gateway_e2e_request_latency_seconds_count 1",
        'tsukimi_gateway_requests_total{route="/v1/chat/completions",code="200"} 1',
        'tsukimi_gateway_requests_total{route="/v1/chat/completions",code="404"} 1',
        "tsukimi_gateway_requests_in_flight 0",
        'tsukimi_gateway_queue_depth{role="prefill"} 3',
        'tsukimi_gateway_queue_depth{role="decode"} 0',
        f"tsukimi_gateway_prompt_tokens_total {num_prompt}",
        "tsukimi_gateway_cached_prompt_tokens_total 16",
        "tsukimi_gateway_generation_tokens_total 3",
    ]:
        assert line in lines, line


async def test_metrics_expose_each_instance_kv_storage_and_traffic(checkpoint: Any) -> None:
    beats = [
        Heartbeat("decode-0", "decode", 1, 0.0, kv_blocks_total=100, kv_blocks_used=7, block_bytes=336720,
                  kv_format="kvquant-3:abc", kv_block_tokens=64, kv_moved_bytes=5000, kv_moved_tokens=300),
        Heartbeat("cache-0", "cache-store", 1, 0.0, kv_blocks_used=3, kv_stored_bytes=990, kv_stored_blocks=3),
    ]
    async with serving(checkpoint, FakeBackend(beats=beats)) as (client, _):
        text = await (await client.get("/metrics")).text()
    lines = set(text.splitlines())
    engine = 'instance="decode-0",role="decode",format="kvquant-3:abc"'
    for line in [
        f"tsukimi_kv_block_bytes{{{engine}}} 336720",
        f"tsukimi_kv_capacity_tokens{{{engine}}} 6400",
        f"tsukimi_kv_used_tokens{{{engine}}} 448",
        'tsukimi_kv_moved_bytes_total{instance="decode-0",role="decode"} 5000',
        'tsukimi_kv_moved_tokens_total{instance="decode-0",role="decode"} 300',
        'tsukimi_kv_store_dram_bytes{instance="cache-0",role="cache-store"} 990',
        'tsukimi_kv_store_dram_blocks{instance="cache-0",role="cache-store"} 3',
    ]:
        assert line in lines, line


async def test_logs_carry_the_internal_id_and_the_client_label(checkpoint: Any) -> None:
    backend = FakeBackend()
    chat = {"model": MODEL, "messages": MESSAGES}
    async with serving(checkpoint, backend) as (client, _):
        with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            await client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-7"})
            await client.post("/v1/chat/completions", json=chat)
    labelled, plain = (s.request_id for s in backend.submits)
    finished = [line for line in logs if line["event"] == "finished"]
    assert [(line["request_id"], line.get("client_request_id")) for line in finished] == [
        (labelled, "trace-7"), (plain, None)]
    assert all("client_request_id" not in line for line in logs if line.get("request_id") == plain)
