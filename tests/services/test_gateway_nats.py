"""The gateway's real `NatsBackend` against a real nats-server; the test plays scheduler, prefill and decode."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from gateway_fakes import MESSAGES, MODEL, model_info, sse_payloads, token_events

from services.gateway.app import Gateway, GatewayConfig
from services.gateway.backend import NatsBackend
from shared.wire.bus import Bus
from shared.wire.protocol import (
    Cancel,
    ErrorType,
    Heartbeat,
    Message,
    StreamEvent,
    Subjects,
    SubmitReply,
    SubmitRequest,
)

SUBJECTS = Subjects("gwtest")


class Cluster:
    """Answers `sched.submit` (rejecting prompts that ask for 1 token) and streams `pieces` in reverse order."""

    def __init__(self, bus: Bus, pieces: list[str], gap_s: float = 0.0) -> None:
        self.bus, self.pieces, self.gap_s = bus, pieces, gap_s
        self.submits: list[SubmitRequest] = []
        self.cancels: list[Cancel] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def on_submit(self, msg: Message) -> Message:
        assert isinstance(msg, SubmitRequest)
        self.submits.append(msg)
        if msg.sampling.max_tokens == 1:
            return SubmitReply(msg.request_id, False, error_type="rejected", reason="busy", retry_after_s=1.5)
        self.tasks.append(asyncio.create_task(self.stream(msg)))
        return SubmitReply(msg.request_id, True, "prefill-0", "decode-0")

    async def stream(self, request: SubmitRequest) -> None:
        await asyncio.sleep(0.05)  # after the reply
        events = token_events(request.request_id, self.pieces, "stop", len(request.prompt_ids), 16)
        for event in reversed(events) if not self.gap_s else events:
            await self.bus.publish(SUBJECTS.stream(request.request_id), event)
            await asyncio.sleep(self.gap_s)

    async def on_cancel(self, msg: Message) -> None:
        assert isinstance(msg, Cancel)
        self.cancels.append(msg)

    async def beat(self) -> None:
        for instance, role in (("scheduler-0", "scheduler"), ("prefill-0", "prefill"), ("decode-0", "decode")):
            await self.bus.publish(SUBJECTS.heartbeat(role, instance), Heartbeat(instance, role, 1, 0.0, num_waiting=2))


@asynccontextmanager
async def gateway_over_nats(nats_url: str, checkpoint: Any) -> AsyncIterator[tuple[Any, NatsBackend, Cluster]]:
    gateway_bus = await Bus.connect(nats_url, "gateway", SUBJECTS)
    cluster = Cluster(await Bus.connect(nats_url, "cluster", SUBJECTS), ["Hello", " from", " NATS"])
    backend = NatsBackend(gateway_bus, instance_timeout_s=5.0)
    await backend.start()
    client = TestClient(TestServer(Gateway(model_info(checkpoint), backend, GatewayConfig(16)).build_app()))
    await client.start_server()
    try:
        yield client, backend, cluster
    finally:
        await client.close()
        for task in cluster.tasks:
            task.cancel()
        await asyncio.gather(*cluster.tasks, return_exceptions=True)
        await backend.stop()
        await gateway_bus.drain()
        await cluster.bus.drain()


async def test_gateway_over_nats_serves_streams_rejects_and_cancels(nats_url: str, checkpoint: Any) -> None:
    async with gateway_over_nats(nats_url, checkpoint) as (client, backend, cluster):
        assert (await client.get("/health")).status == 503
        await cluster.bus.serve(SUBJECTS.submit, cluster.on_submit)
        await cluster.bus.serve(SUBJECTS.cancel, cluster.on_cancel)
        await cluster.beat()
        await _eventually(lambda: backend.num_alive("decode") == 1)
        health = {"status": "ok", "scheduler": 1, "prefill": 1, "decode": 1}
        assert await (await client.get("/health")).json() == health
        assert 'tsukimi_gateway_queue_depth{role="decode"} 2' in await (await client.get("/metrics")).text()

        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        body = await resp.json()
        assert resp.status == 200 and body["choices"][0]["message"]["content"] == "Hello from NATS"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
        assert cluster.submits[0].prompt_ids == checkpoint.tokenizer.encode_chat(MESSAGES)

        stream = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True})
        texts = [p["choices"][0]["text"] for p in sse_payloads(await stream.text())[:-1]]
        assert texts == ["Hello", " from", " NATS"]

        rejected = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert rejected.status == 429 and rejected.headers["Retry-After"] == "2"
        assert not cluster.cancels

        cluster.pieces, cluster.gap_s = [f"t{i}" for i in range(100)], 0.05
        dropped = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True})
        first = await dropped.content.readuntil(b"\n\n")
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "t0"
        dropped.close()
        await _eventually(lambda: bool(cluster.cancels) and backend.num_open_streams == 0)
        assert cluster.cancels[0].request_id == dropped.headers["X-Request-Id"]
        left = [sub.subject for sub in backend.bus.client._subs.values()]
        assert SUBJECTS.heartbeat_all in left and not [s for s in left if s.startswith(SUBJECTS.stream(""))], left


async def test_the_schedulers_failures_reach_their_clients(nats_url: str, checkpoint: Any) -> None:
    """An instance died holding the request: the scheduler says so on `sched.failed` (it may not publish on the
    request's own stream), and the client gets the 503 at once."""
    async with gateway_over_nats(nats_url, checkpoint) as (client, backend, cluster):
        async def accept_then_lose(msg: Message) -> Message:
            assert isinstance(msg, SubmitRequest)
            failure = StreamEvent.failure(msg.request_id, ErrorType.UNAVAILABLE, "decode-0 stopped responding")
            cluster.tasks.append(asyncio.create_task(_later(cluster.bus.publish(SUBJECTS.failed, failure))))
            return SubmitReply(msg.request_id, True, "prefill-0", "decode-0")

        await cluster.bus.serve(SUBJECTS.submit, accept_then_lose)
        await cluster.beat()
        await _eventually(lambda: backend.num_alive("decode") == 1)
        lost = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        assert lost.status == 503 and "decode-0 stopped responding" in (await lost.json())["error"]["message"]
        await cluster.bus.publish(SUBJECTS.failed, StreamEvent.failure("nobody", ErrorType.UNAVAILABLE, "x"))
        await _eventually(lambda: backend.num_open_streams == 0)


async def _later(publishing: Any) -> None:
    await asyncio.sleep(0.05)  # after the reply
    await publishing


async def _eventually(condition: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
