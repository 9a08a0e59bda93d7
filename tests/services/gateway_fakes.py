"""A scripted stand-in for the cluster behind the gateway (`Backend`), and a gateway test server around it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from aiohttp.web_runner import BaseRunner

from services.gateway.app import Gateway, GatewayConfig
from services.gateway.backend import BackendUnavailable
from services.gateway.http_server import GatewayRunner, runner_options
from services.gateway.prompt import ModelInfo
from shared.model.checkpoint import Checkpoint
from shared.wire.protocol import Heartbeat, StreamEvent, SubmitReply, SubmitRequest

MODEL = "test-model"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]

KV_CODEC = "fp32"  # the engines' default KV format (EngineConfig.kv_format)


def sse_payloads(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body: JSON objects, and the string "[DONE]"."""
    assert text.endswith("\n\n"), text[-50:]
    out: list[Any] = []
    for event in text.strip("\n").split("\n\n"):
        assert event.startswith("data: "), event
        data = event.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


Script = Callable[[SubmitRequest], tuple[SubmitReply, list[StreamEvent]]]


def token_events(
    request_id: str, pieces: list[str], finish: str = "stop", num_prompt_tokens: int = 0, num_cached: int = 0
) -> list[StreamEvent]:
    """One event per piece (one token each, ids 1000+i), the last with `finish`."""
    return [
        StreamEvent(
            request_id, i, [1000 + i], text, (finish or None) if i == len(pieces) - 1 else None,
            num_prompt_tokens=num_prompt_tokens, num_cached_tokens=num_cached,
        )
        for i, text in enumerate(pieces)
    ]


def answering(pieces: list[str], finish: str = "stop", num_cached: int = 0) -> Script:
    """A script that accepts every request and streams `pieces`."""

    def script(request: SubmitRequest) -> tuple[SubmitReply, list[StreamEvent]]:
        events = token_events(request.request_id, pieces, finish, len(request.prompt_ids), num_cached)
        return SubmitReply(request.request_id, True, "p0", "d0"), events

    return script


class FakeStream:
    def __init__(self, backend: FakeBackend, request_id: str) -> None:
        self.backend, self.request_id = backend, request_id
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()

    async def next_event(self, timeout_s: float) -> StreamEvent | None:
        try:
            return await asyncio.wait_for(self.queue.get(), timeout_s)
        except TimeoutError:
            return None

    async def close(self) -> None:
        self.backend.open_streams.pop(self.request_id, None)


@dataclass
class FakeBackend:
    """Answers submits with `script`; feeds the events `event_gap_s` apart into the request's open stream.

    Records submits, cancels and the streams still open; `is_scheduler_down` makes submit raise; with `hold` set,
    every event after a request's first waits for it (a request then stays in flight until the test says).
    """

    script: Script = field(default_factory=lambda: answering(["Hello", ",", " world"]))
    event_gap_s: float = 0.0
    hold: asyncio.Event | None = None
    is_scheduler_down: bool = False
    alive: dict[str, int] = field(default_factory=lambda: {"scheduler": 1, "prefill": 1, "decode": 1})
    waiting: dict[str, int] = field(default_factory=dict)
    beats: list[Heartbeat] = field(default_factory=list)  # what `instances` reports (the KV metrics read them)
    submits: list[SubmitRequest] = field(default_factory=list)
    cancels: list[tuple[str, str]] = field(default_factory=list)
    open_streams: dict[str, FakeStream] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def open_stream(self, request_id: str) -> FakeStream:
        stream = FakeStream(self, request_id)
        self.open_streams[request_id] = stream
        return stream

    async def submit(self, request: SubmitRequest) -> SubmitReply:
        self.submits.append(request)
        if self.is_scheduler_down:
            raise BackendUnavailable("no responders")
        reply, events = self.script(request)
        if reply.accepted:
            self.tasks.append(asyncio.create_task(self._feed(request.request_id, events)))
        return reply

    async def _feed(self, request_id: str, events: list[StreamEvent]) -> None:
        for index, event in enumerate(events):
            await asyncio.sleep(self.event_gap_s)
            if index == 1 and self.hold is not None:
                await self.hold.wait()
            stream = self.open_streams.get(request_id)
            if stream is None:
                return
            stream.queue.put_nowait(event)

    async def cancel(self, request_id: str, reason: str) -> None:
        self.cancels.append((request_id, reason))

    def num_alive(self, role: str) -> int:
        return self.alive.get(role, 0)

    def num_waiting(self, role: str) -> int:
        return self.waiting.get(role, 0)

    def instances(self) -> list[Heartbeat]:
        return list(self.beats)


def model_info(checkpoint: Checkpoint, context_len: int | None = None) -> ModelInfo:
    return ModelInfo(
        MODEL, checkpoint.tokenizer, checkpoint.fingerprint, context_len or checkpoint.config.max_position,
        checkpoint.config.vocab_size, KV_CODEC,
    )


class GatewayTestServer(TestServer):
    """aiohttp's test server with the gateway's own runner (JSON for aiohttp's errors, its connection timeouts)."""

    def __init__(self, gateway: Gateway) -> None:
        super().__init__(gateway.build_app())
        self.read_timeout_s = gateway.config.http_read_timeout_s

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        return GatewayRunner(self.app, **{**kwargs, **runner_options(self.read_timeout_s)})


@asynccontextmanager
async def serving(
    checkpoint: Checkpoint, backend: FakeBackend, config: GatewayConfig | None = None, context_len: int | None = None
) -> AsyncIterator[tuple[Any, Gateway]]:
    """A gateway on a loopback port in front of `backend`, and an HTTP client for it."""
    gateway = Gateway(model_info(checkpoint, context_len), backend, config or GatewayConfig(block_size=16))
    client: Any = TestClient(GatewayTestServer(gateway))
    await client.start_server()
    try:
        yield client, gateway
    finally:
        await client.close()
        for task in backend.tasks:
            task.cancel()
        await asyncio.gather(*backend.tasks, return_exceptions=True)
