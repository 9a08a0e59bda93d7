"""The gateway's HTTP server over real sockets on 127.0.0.1: slow, idle and malformed connections are closed within a
bound, and aiohttp's own errors answer with OpenAI error objects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from gateway_fakes import MESSAGES, MODEL, FakeBackend, serving
from test_gateway_errors import assert_error

from services.gateway.app import GatewayConfig

READ_TIMEOUT_S = 1.0
CLOSED_WITHIN_S = 10.0  # a generous bound on "closed": the timeout plus scheduling on a busy machine
CHAT = json.dumps({"model": MODEL, "messages": MESSAGES}).encode()


@asynccontextmanager
async def gateway(checkpoint: Any) -> AsyncIterator[tuple[str, int]]:
    config = GatewayConfig(block_size=16, http_read_timeout_s=READ_TIMEOUT_S)
    async with serving(checkpoint, FakeBackend(), config) as (client, _):
        yield client.host, client.port


async def read_all(reader: asyncio.StreamReader, within_s: float = CLOSED_WITHIN_S) -> bytes:
    """Everything the server sends until it closes the connection (fails if it stays open longer)."""
    return await asyncio.wait_for(reader.read(), within_s)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


async def test_a_slowloris_trickling_headers_is_closed(checkpoint: Any) -> None:
    async with gateway(checkpoint) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSED_WITHIN_S
        closed = False
        while loop.time() < deadline and not closed:  # one header byte every 0.2 s, never the blank line
            try:
                writer.write(b"X")
                await writer.drain()
                closed = await asyncio.wait_for(reader.read(1), 0.2) == b""
            except TimeoutError:
                continue
            except ConnectionError:
                closed = True
        writer.close()
        assert closed, "the server kept a connection whose headers never ended"


async def test_an_idle_connection_is_closed_and_keep_alive_works_until_then(checkpoint: Any) -> None:
    async with gateway(checkpoint) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        for _ in range(2):  # two requests on one connection: keep-alive
            writer.write(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
            status_line = await reader.readline()
            assert status_line.startswith(b"HTTP/1.1 200")
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
            await reader.readexactly(length)
        assert await read_all(reader) == b""  # then it idles past the timeout: closed
        writer.close()


async def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(checkpoint: Any) -> None:
    async with gateway(checkpoint) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
               f"Content-Length: {len(CHAT)}\r\n\r\n"
        writer.write(head.encode() + CHAT[:10])  # and the rest never comes
        status, headers, body = parse_response(await read_all(reader))  # the timeout, then at most LINGER_S
        writer.close()
    assert status == 408 and headers["connection"] == "close"
    assert_error(json.loads(body), code="request_timeout")


async def test_malformed_http_gets_a_json_400(checkpoint: Any) -> None:
    requests = [
        b"GARBAGE\r\n\r\n",
        b"GET /live HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"GET /live HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 10_000 + b"\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    ]
    async with gateway(checkpoint) as (host, port):
        for raw in requests:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(raw)
            status, headers, body = parse_response(await read_all(reader))
            writer.close()
            assert status == 400, raw[:40]
            assert headers["content-type"].startswith("application/json"), (raw[:40], body)
            assert_error(json.loads(body), code="invalid_request")
