"""The gateway's HTTP server around its aiohttp app: connection timeouts, and OpenAI error objects for the errors
aiohttp answers itself, before any route or middleware runs (a malformed request line or header: plain text else).

Timeouts: aiohttp closes a connection that waits for a request (idle keep-alive, or headers still arriving) longer
than its `keepalive_timeout`, counted from the connection's start or the previous response, so that bounds both
header reads and idleness; the body is read under a deadline by the handlers (json_body.read_body).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from services.gateway.errors import for_status
from shared.wire.log import get_logger

log = get_logger(__name__)
# After an answer that closes the connection (a 408), how long the rest of a body may still be read and dropped, so
# that the client sees the answer rather than a reset (aiohttp's default, 10 s, would keep a stalled client that long)
LINGER_S = 2.0


class _JsonErrorHandler(RequestHandler):
    """aiohttp's protocol, answering its own errors with a JSON error object (and closing, as aiohttp does)."""

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # part of a response went out: only closing is left
            raise ConnectionError("response already started")
        if status >= 500:
            log.error("request failed outside the app", status=status, exc_info=exc)
        else:
            log.info("malformed HTTP request", status=status, error=message or repr(exc))
        text = {400: f"malformed HTTP request: {message or exc}", 504: "the request handler timed out"}
        error = for_status(status, text.get(status, "internal error"))
        response = web.json_response(error.body(), status=status, headers=error.headers)
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer aiohttp's own errors as JSON."""

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return _JsonErrorServer(
            plain.request_handler, request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation, loop=plain._loop, **plain._kwargs,
        )


def runner_options(read_timeout_s: float) -> dict[str, Any]:
    """The arguments every gateway runner gets (tests' servers too)."""
    return {"handler_cancellation": True, "access_log": None, "keepalive_timeout": read_timeout_s,
            "lingering_time": LINGER_S}


def make_runner(app: web.Application, read_timeout_s: float) -> GatewayRunner:
    """The runner of `app`: cancels a handler whose client went away, no access log (the middleware logs), and
    closes connections waiting longer than `read_timeout_s` for a request."""
    return GatewayRunner(app, **runner_options(read_timeout_s))
