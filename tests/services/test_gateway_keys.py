"""API keys: the key file, bearer tokens, per-key limits on a fake clock, and the gateway answering 401 and 429."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from gateway_fakes import MESSAGES, MODEL, FakeBackend, answering, serving
from test_gateway_errors import _eventually, assert_error

from services.gateway.app import GatewayConfig
from services.gateway.auth import authenticate, bearer_token
from services.gateway.errors import ApiError
from services.gateway.limits import KeyLimits, TokenBucket
from shared.wire.api_keys import ApiKey, ApiKeys, ApiKeysError, hash_key, load_api_keys

CHAT = {"model": MODEL, "messages": MESSAGES}
ALICE, BOB = "tsk-alice-secret", "tsk-bob-secret"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keys(**limits: Any) -> ApiKeys:
    return ApiKeys((ApiKey("alice", hash_key(ALICE), **limits), ApiKey("bob", hash_key(BOB))))


def test_keys_are_found_by_hash_and_the_file_never_holds_them(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    entry = {"name": "alice", "sha256": hash_key(ALICE), "requests_per_minute": 60, "tokens_per_minute": None}
    path.write_text(json.dumps({"version": 1, "keys": [entry]}))
    loaded = load_api_keys(path)
    assert loaded.keys == (ApiKey("alice", hash_key(ALICE), requests_per_minute=60),)
    assert loaded.find(ALICE) == loaded.keys[0]
    assert loaded.find(ALICE + "x") is None and loaded.find("") is None
    assert loaded.find("\udcff") is None  # a header's undecodable byte hashes instead of raising
    assert ALICE not in path.read_text() and len(hash_key(ALICE)) == 64


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("{", "not JSON"),
        ('{"keys": []}', "version"),
        ('{"version": 1}', "keys"),
        ('{"version": 1, "keys": []}', "holds no key"),
        ('{"version": 1, "keys": [{"name": "a b", "sha256": "' + "0" * 64 + '"}]}', "name"),
        ('{"version": 1, "keys": [{"name": "a", "sha256": "tsk-plain-key"}]}', "sha256"),
        ('{"version": 1, "keys": [{"name": "a", "sha256": "' + "0" * 64 + '", "max_concurrent": 0}]}',
         "max_concurrent"),
        ('{"version": 1, "keys": [{"name": "a", "sha256": "' + "0" * 64 + '"}, {"name": "a", "sha256": "'
         + "1" * 64 + '"}]}', "more than once"),
    ],
)
def test_a_bad_key_file_is_a_config_error_naming_the_problem(tmp_path: Path, content: str | None,
                                                             message: str) -> None:
    path = tmp_path / "keys.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ApiKeysError, match=message):
        load_api_keys(path)


def test_bearer_tokens_and_authentication() -> None:
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None and bearer_token(None) is None
    assert authenticate(None, None) is None  # no key file: everyone is welcome
    assert authenticate(keys(), f"Bearer {BOB}") == keys().keys[1]
    for header in (None, "Bearer wrong", ALICE):
        with pytest.raises(ApiError) as raised:
            authenticate(keys(), header)
        assert raised.value.status == 401 and raised.value.code == "invalid_api_key"
        assert raised.value.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_token_bucket_holds_a_minute_and_refills_evenly() -> None:
    bucket = TokenBucket(capacity=60.0, level=60.0, updated_at=0.0)
    assert bucket.take(60, now=0.0) == 0.0
    assert bucket.take(1, now=0.0) == pytest.approx(1.0)  # 1 a second
    assert bucket.take(10, now=5.0) == pytest.approx(5.0) and bucket.level == pytest.approx(5.0)
    bucket.give_back(1000, now=5.0)
    assert bucket.level == 60.0


def test_requests_per_minute_and_concurrency_refuse_with_retry_after() -> None:
    clock = Clock()
    limits = KeyLimits(clock)
    alice = ApiKey("alice", hash_key(ALICE), requests_per_minute=2, max_concurrent=2)
    first, _ = limits.admit(alice), limits.admit(alice)
    with pytest.raises(ApiError) as busy:
        limits.admit(alice)
    assert busy.value.status == 429 and "max_concurrent" in busy.value.message
    limits.finish(first, 0)
    limits.finish(first, 0)  # twice is once
    assert limits.num_in_flight(alice) == 1
    with pytest.raises(ApiError) as per_minute:
        limits.admit(alice)
    assert "requests per minute" in per_minute.value.message and per_minute.value.headers["Retry-After"] == "30"
    clock.now += 30.0
    limits.admit(alice)  # half a minute brought one request back


def test_tokens_are_reserved_at_admission_and_settled_at_the_end() -> None:
    clock = Clock()
    limits = KeyLimits(clock)
    alice = ApiKey("alice", hash_key(ALICE), tokens_per_minute=1000)
    ticket = limits.admit(alice)
    limits.reserve_tokens(ticket, 600)  # prompt plus max_tokens
    with pytest.raises(ApiError) as short:
        limits.reserve_tokens(limits.admit(alice), 600)
    assert short.value.status == 429 and short.value.headers["Retry-After"] == "12"  # 200 more at 1000 a minute
    limits.finish(ticket, 150)  # it stopped early: 450 flow back
    limits.reserve_tokens(limits.admit(alice), 850)
    with pytest.raises(ApiError) as never:
        limits.reserve_tokens(limits.admit(alice), 1001)
    assert never.value.code == "tokens_per_minute_exceeded"


async def test_the_gateway_needs_a_key_where_keys_are_configured(checkpoint: Any) -> None:
    backend = FakeBackend(answering(["Hi"]))
    async with serving(checkpoint, backend, GatewayConfig(block_size=16, api_keys=keys())) as (client, _):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": ALICE}):
            resp = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
            assert_error(await resp.json(), code="invalid_api_key")
        assert (await client.get("/v1/models")).status == 401
        assert (await client.get(f"/v1/models/{MODEL}", headers={"Authorization": f"Bearer {BOB}"})).status == 200
        for path in ("/health", "/live", "/metrics", "/openapi.json"):  # health checks and scrapers hold no key
            assert (await client.get(path)).status == 200, path
        api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=ALICE, max_retries=0)
        chat = await api.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == "Hi"
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0).models.list()
        document = await (await client.get("/openapi.json")).json()
        assert document["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
        await api.close()
    assert len(backend.submits) == 1


async def test_a_key_over_its_limits_gets_429_with_retry_after(checkpoint: Any) -> None:
    backend = FakeBackend(answering(["a", "b"]), hold=asyncio.Event())
    config = GatewayConfig(block_size=16, api_keys=keys(requests_per_minute=2, max_concurrent=1))
    alice, bob = {"Authorization": f"Bearer {ALICE}"}, {"Authorization": f"Bearer {BOB}"}
    async with serving(checkpoint, backend, config) as (client, gateway):
        first = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=alice)
        first_resp = await first
        busy = await client.post("/v1/chat/completions", json=CHAT, headers=alice)
        assert busy.status == 429 and busy.headers["Retry-After"] == "1"
        assert_error(await busy.json(), code="rate_limit_exceeded")
        bob_answer = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=bob))
        await _eventually(lambda: len(gateway.active_request_ids) == 2)  # bob: no limits
        backend.hold.set()  # type: ignore[union-attr]
        assert (await bob_answer).status == 200
        await first_resp.text()
        await _eventually(lambda: gateway.limits.num_in_flight(config.api_keys.keys[0]) == 0)  # type: ignore[union-attr]
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=alice)).status == 200
        over = await client.post("/v1/chat/completions", json=CHAT, headers=alice)  # a refusal did not count
        assert over.status == 429 and 1 <= int(over.headers["Retry-After"]) <= 30
        assert "requests per minute" in (await over.json())["error"]["message"]


async def test_a_key_reserves_prompt_plus_max_tokens_and_gets_back_what_was_unused(checkpoint: Any) -> None:
    backend = FakeBackend(answering(["a", "b"]))
    num_prompt = len(checkpoint.tokenizer.encode_chat(MESSAGES))
    reserved, used = num_prompt + 90, num_prompt + 2
    tokens_per_minute = reserved + 2 * used  # three requests fit only if each gives back what it did not use
    config = GatewayConfig(block_size=16, api_keys=keys(tokens_per_minute=tokens_per_minute))
    alice = {"Authorization": f"Bearer {ALICE}"}
    async with serving(checkpoint, backend, config) as (client, _):
        larger = {**CHAT, "max_tokens": tokens_per_minute - num_prompt + 1}
        too_large = await client.post("/v1/chat/completions", json=larger, headers=alice)
        assert too_large.status == 429
        assert_error(await too_large.json(), code="tokens_per_minute_exceeded")
        for _ in range(3):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 90}, headers=alice)
            assert resp.status == 200, await resp.text()
        refused = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 90}, headers=alice)
        assert refused.status == 429 and "tokens per minute" in (await refused.json())["error"]["message"]
    assert len(backend.submits) == 3
