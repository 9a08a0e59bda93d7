"""What the gateway refuses before any work: malformed bodies (bad UTF-8, lone surrogates, deep nesting, NaN), OpenAI
fields it cannot honour, sampling values out of OpenAI's ranges; and the model card and the OpenAPI document."""

from __future__ import annotations

import json
from typing import Any

import pytest
from gateway_fakes import MESSAGES, MODEL, FakeBackend, serving
from test_gateway_errors import assert_error

CHAT = {"model": MODEL, "messages": MESSAGES}


@pytest.mark.parametrize(
    ("data", "param"),
    [
        (b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\\ud800"}]}',
         "messages[0].content"),
        (b'{"model": "x", "\\udfff": 1}', None),  # a key
        (b"[" * 50_000 + b"]" * 50_000, None),
        (b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
        ('{"model": "é"}'.encode("latin-1"), None),  # invalid UTF-8
        ('{"model": "x"}'.encode("utf-16"), None),  # JSON, but not UTF-8
        (b'{"model": "x", "temperature": NaN}', None),
        (b'{"model": "x", "max_tokens": Infinity}', None),
        (b'{"model": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),  # too many digits to convert
    ],
)
async def test_malformed_bodies_get_400_with_an_error_object(checkpoint: Any, data: bytes, param: str | None) -> None:
    backend = FakeBackend()
    async with serving(checkpoint, backend) as (client, _):
        for path in ("/v1/chat/completions", "/v1/completions"):
            resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
            assert resp.status == 400, await resp.text()
            assert_error(await resp.json(), param)
    assert not backend.submits


async def test_a_deeply_nested_value_in_a_field_gets_400_not_500(checkpoint: Any) -> None:
    deep: Any = 1
    for _ in range(900):  # within json's nesting limit, too deep to print back
        deep = [deep]
    async with serving(checkpoint, FakeBackend()) as (client, _):
        resp = await client.post("/v1/chat/completions", data=json.dumps({**CHAT, "max_tokens": deep}))
        assert resp.status == 400
        assert_error(await resp.json(), "max_tokens")


UNSUPPORTED: list[tuple[str, Any]] = [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("logit_bias", {"50256": -100}),
    ("logprobs", True),
    ("top_logprobs", 2),
    ("frequency_penalty", 0.5),
    ("frequency_penalty", False),  # not a number
    ("presence_penalty", -1),
    ("presence_penalty", "0"),
    ("repetition_penalty", 1.2),
    ("min_p", 0.1),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "high"),
    ("guided_json", {"type": "object"}),
]


@pytest.mark.parametrize(("field", "value"), UNSUPPORTED)
async def test_fields_it_cannot_honour_get_400_naming_them(checkpoint: Any, field: str, value: Any) -> None:
    backend = FakeBackend()
    async with serving(checkpoint, backend) as (client, _):
        resp = await client.post("/v1/chat/completions", json={**CHAT, field: value})
        assert resp.status == 400, await resp.text()
        body = await resp.json()
        assert_error(body, field)
        if field != "logprobs":
            completion = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", field: value})
            assert completion.status == 400 and (await completion.json())["error"]["param"] == field
    assert not backend.submits


async def test_neutral_values_of_those_fields_are_accepted(checkpoint: Any) -> None:
    neutral = {
        "tools": [], "tool_choice": "none", "functions": None, "function_call": "none",
        "response_format": {"type": "text"}, "logit_bias": {}, "logprobs": False, "top_logprobs": 0,
        "frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "modalities": ["text"],
        "parallel_tool_calls": True, "user": "u-1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
    }
    backend = FakeBackend()
    async with serving(checkpoint, backend) as (client, _):
        resp = await client.post("/v1/chat/completions", json={**CHAT, **neutral})
        assert resp.status == 200, await resp.text()
        completion = {"model": MODEL, "prompt": "x", "echo": False, "best_of": 1, "suffix": "", "logprobs": None}
        assert (await client.post("/v1/completions", json=completion)).status == 200
    assert len(backend.submits) == 2


@pytest.mark.parametrize(
    ("field", "value", "is_ok"),
    [("temperature", 0, True), ("temperature", 2, True), ("temperature", 2.01, False), ("temperature", 100, False),
     ("top_p", 1, True), ("top_p", 0.01, True), ("top_p", 0, False), ("top_p", 1.5, False), ("top_p", -0.5, False)],
)
async def test_temperature_and_top_p_take_openai_ranges(checkpoint: Any, field: str, value: float, is_ok: bool) -> None:
    async with serving(checkpoint, FakeBackend()) as (client, _):
        resp = await client.post("/v1/chat/completions", json={**CHAT, field: value})
        assert resp.status == (200 if is_ok else 400), await resp.text()
        if not is_ok:
            assert_error(await resp.json(), field)


async def test_one_model_can_be_looked_up_by_id(checkpoint: Any) -> None:
    async with serving(checkpoint, FakeBackend()) as (client, gateway):
        resp = await client.get(f"/v1/models/{MODEL}")
        assert resp.status == 200
        assert await resp.json() == {"id": MODEL, "object": "model", "created": gateway.created, "owned_by": "tsukimi"}
        missing = await client.get("/v1/models/gpt-4o/with-a-slash")
        assert missing.status == 404
        assert_error(await missing.json(), "model", "model_not_found")


async def test_the_openapi_document_describes_the_routes_it_serves(checkpoint: Any) -> None:
    async with serving(checkpoint, FakeBackend()) as (client, gateway):
        resp = await client.get("/openapi.json")
        assert resp.status == 200
        document = await resp.json()
        routes = {(r.method.lower(), r.resource.canonical) for r in gateway.build_app().router.routes()
                  if r.method != "HEAD" and r.resource is not None}
    assert document["openapi"] == "3.1.0"
    documented = {(method, path.replace("{model}", "{model_id}")) for path, ops in document["paths"].items()
                  for method in ops}
    assert documented == routes
    schemas = document["components"]["schemas"]
    assert schemas["CreateChatCompletionRequest"]["properties"]["model"]["enum"] == [MODEL]
    assert "securitySchemes" not in document["components"]  # no key file: no keys
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "429", "503", "504"} <= set(chat) and "401" not in chat
    assert "Retry-After" in chat["429"]["headers"] and "Retry-After" in chat["503"]["headers"]
