"""One streamed request against an OpenAI-compatible server (aiohttp): the body, reading the server-sent events,
and the record of what happened. A failing request never raises: its record says what went wrong.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from loadgen.record import RequestRecord
from loadgen.workload import PlannedRequest

API_COMPLETIONS = "completions"
API_CHAT = "chat"
_PATHS = {API_COMPLETIONS: "/v1/completions", API_CHAT: "/v1/chat/completions"}


class ServerError(Exception):
    """The server cannot be reached, or does not say which model it serves."""


@dataclass(frozen=True)
class ClientOptions:
    """How to send requests.

    Args:
        base_url: scheme://host:port (see `normalize_base_url`).
        model: the `model` field.
        api: "completions" (prompt as given: token ids or text) or "chat" (one user message; needs text prompts).
        request_timeout_s: a request still unanswered after this long fails.
        ignore_eos: send `ignore_eos: true` so every request produces exactly `max_tokens` tokens.
        extra_body: merged into every body last (it may override any field).
        api_key: sent as `Authorization: Bearer <key>` ("": no header).
    """

    base_url: str
    model: str
    api: str = API_COMPLETIONS
    request_timeout_s: float = 600.0
    ignore_eos: bool = True
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    api_key: str = field(default="", repr=False)

    @property
    def endpoint(self) -> str:
        return self.base_url + _PATHS[self.api]

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)


def auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def normalize_base_url(url: str) -> str:
    """`http(s)://host[:port][/prefix]` without a trailing slash or `/v1`. Raises ValueError for anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"the URL must not have a query or fragment: {url!r}")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


def request_body(planned: PlannedRequest, options: ClientOptions) -> dict[str, Any]:
    """The JSON body for `planned`. Raises ValueError for token ids on the chat API."""
    body: dict[str, Any] = {"model": options.model}
    if options.api == API_CHAT:
        if not isinstance(planned.prompt, str):
            raise ValueError("the chat API needs text prompts (see workload.as_text)")
        body["messages"] = [{"role": "user", "content": planned.prompt}]
    else:
        body["prompt"] = planned.prompt
    body.update(
        max_tokens=planned.output_len,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    if options.ignore_eos:
        body["ignore_eos"] = True
    body.update(options.extra_body)
    return body


async def fetch_model_ids(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float = 10.0, api_key: str = ""
) -> list[str]:
    """The model ids of GET /v1/models; [] when the server answers but lists none (or has no such route).

    Raises:
        ServerError: nothing answers at `base_url` (refused, unknown host, timeout), or it refuses the key (401).
    """
    url = base_url + "/v1/models"
    try:
        async with asyncio.timeout(timeout_s), session.get(url, headers=auth_headers(api_key)) as response:
            if response.status == 401:
                raise ServerError(f"{url} answered 401: pass a valid --api-key")
            if response.status != 200:
                return []
            body = await response.json(content_type=None)
    except (aiohttp.ClientConnectionError, TimeoutError, OSError) as exc:
        raise ServerError(f"cannot reach the server at {base_url}: {_describe(exc)}") from None
    except (aiohttp.ClientError, ValueError):
        return []
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list):
        return []
    return [m["id"] for m in models if isinstance(m, dict) and isinstance(m.get("id"), str)]


async def resolve_model(base_url: str, model: str | None, api_key: str = "") -> str:
    """`model`, or the first id of GET /v1/models; either way the server must answer. Raises ServerError."""
    async with aiohttp.ClientSession() as session:
        model_ids = await fetch_model_ids(session, base_url, api_key=api_key)
    if model:
        return model
    if not model_ids:
        raise ServerError(f"{base_url}/v1/models lists no model; pass --model")
    return model_ids[0]


async def send_request(
    session: aiohttp.ClientSession, planned: PlannedRequest, options: ClientOptions, t0: float, arrival_s: float
) -> RequestRecord:
    """Send `planned`, stream its answer, and record it; times are `time.perf_counter() - t0`.

    Never raises for a failed request (its record has `error` set); only cancellation propagates.
    """
    record = RequestRecord(planned.request_id, arrival_s, planned.input_len, planned.output_len)
    if isinstance(planned.prompt, list):
        record.num_prompt_tokens = len(planned.prompt)
    try:
        body = request_body(planned, options)
        record.send_s = time.perf_counter() - t0
        async with asyncio.timeout(options.request_timeout_s):
            async with session.post(options.endpoint, json=body, headers=options.headers) as response:
                record.status = response.status
                if response.status != 200:
                    record.retry_after_s = _retry_after_s(response.headers.get("Retry-After"))
                    record.error = f"HTTP {response.status}: {_error_message(await response.read())}"
                else:
                    await _read_stream(response, record, t0)
    except TimeoutError:
        record.error = f"timed out after {options.request_timeout_s:g} s"
    except aiohttp.ClientConnectionError as exc:
        record.error = f"connection failed: {_describe(exc)}"
    except Exception as exc:  # the record must say what happened, whatever it was
        record.error = _describe(exc)
    record.done_s = time.perf_counter() - t0
    if record.send_s is None:  # failed before sending (a bad body): count it as sent and failed at once
        record.send_s = record.done_s
    return record


def _retry_after_s(header: str | None) -> float | None:
    """`Retry-After` in whole seconds (RFC 9110 also allows an HTTP date, which no LLM server sends: ignored)."""
    if header is None or not header.strip().isdigit():
        return None
    return float(header.strip())


async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord, t0: float) -> None:
    """Consume the SSE stream into `record`: content chunk times, usage, a mid-stream error, [DONE]."""
    events = _SseEvents()
    num_chunks = 0
    async for data in response.content.iter_any():
        now = time.perf_counter() - t0
        for payload in events.feed(data):
            if payload == "[DONE]":
                if not record.num_output_tokens:
                    record.num_output_tokens = num_chunks
                return
            event = json.loads(payload)
            if not isinstance(event, dict):
                raise ValueError(f"a stream event is not a JSON object: {payload[:200]!r}")
            if event.get("error") is not None:
                record.error = f"error in stream: {_error_text(event)}"
                return
            if _has_content(event):
                record.chunk_times_s.append(now)
                num_chunks += 1
            if isinstance(event.get("usage"), dict):
                _read_usage(event["usage"], record)
    record.error = "the stream ended without [DONE]"


def _has_content(event: dict[str, Any]) -> bool:
    """A chunk with output: non-empty `text` (completions), `delta.content` or `delta.reasoning_content` (chat),
    or `token_ids`."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        delta = {}
    candidates = (choice.get("text"), delta.get("content"), delta.get("reasoning_content"), choice.get("token_ids"))
    return any(candidates)


def _read_usage(usage: dict[str, Any], record: RequestRecord) -> None:
    if isinstance(usage.get("prompt_tokens"), int):
        record.num_prompt_tokens = usage["prompt_tokens"]
    if isinstance(usage.get("completion_tokens"), int):
        record.num_output_tokens = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        record.num_cached_tokens = details["cached_tokens"]


class _SseEvents:
    """Splits a byte stream into server-sent events and returns each event's `data` (lines joined)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self._buffer = (self._buffer + data).replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        payloads = []
        for event in events:
            lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                payloads.append(b"\n".join(lines).decode("utf-8"))
        return payloads


def _error_message(body: bytes) -> str:
    """The message of an OpenAI error object, else the start of the body."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body[:200].decode("utf-8", "replace").strip() or "(empty body)"
    return _error_text(obj) if isinstance(obj, dict) else str(obj)[:200]


def _error_text(obj: dict[str, Any]) -> str:
    error = obj.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return json.dumps(error if error is not None else obj)[:200]


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
