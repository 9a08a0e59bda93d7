"""The gateway's HTTP side: aiohttp routes (OpenAI API, models, health, liveness, metrics) and the middleware
that gives every request an id, a JSON error body and a metrics count. The cluster is behind `Backend`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from services.gateway.backend import ROLES_FOR_HEALTH, Backend
from services.gateway.errors import ApiError, bad_request, for_status
from services.gateway.kv_metrics import KvMetrics
from services.gateway.metrics import CONTENT_TYPE, GatewayMetrics, RequestTimer
from services.gateway.openai_api import (
    ChatRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_object,
)
from services.gateway.prompt import ModelInfo, PreparedPrompt, PromptBuilder
from services.gateway.responses import ResponseMeta, model_list
from services.gateway.session import Session
from services.gateway.streaming import stream_answer, whole_answer
from shared.log import get_logger
from shared.protocol import SubmitRequest, is_valid_request_id

log = get_logger(__name__)
REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = web.RequestKey("request_id", str)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class GatewayConfig:
    """HTTP-side settings (from `Settings`: block_size, request_timeout_s, max_body_bytes; `health_roles` from the
    deployment: a colocated one has no prefill pool)."""

    block_size: int = 64
    request_timeout_s: float = 300.0
    max_body_bytes: int = 1 << 20
    health_roles: tuple[str, ...] = ROLES_FOR_HEALTH


class Gateway:
    """The gateway's state: the model's tokenizer and limits, the backend, metrics, the requests in flight.

    Args:
        model: the served model.
        backend: the cluster (NATS in production, a fake in tests).
        config: HTTP-side settings.
    """

    def __init__(self, model: ModelInfo, backend: Backend, config: GatewayConfig) -> None:
        self.model, self.backend, self.config = model, backend, config
        self.prompts = PromptBuilder(model, config.block_size)
        self.metrics = GatewayMetrics()
        self.kv_metrics = KvMetrics()
        self.active_request_ids: set[str] = set()
        self.created = int(time.time())

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._middleware])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        header = request.headers.get(REQUEST_ID_HEADER)
        request_id = header if header is not None else uuid.uuid4().hex
        echo = {REQUEST_ID_HEADER: request_id} if is_valid_request_id(request_id) else {}
        request[REQUEST_ID] = request_id
        with structlog.contextvars.bound_contextvars(request_id=request_id[:128]):
            try:
                if not echo:
                    raise bad_request(f"{REQUEST_ID_HEADER} must be 1-128 letters, digits, '-' or '_'")
                response = await handler(request)
            except ApiError as exc:
                response = self._error_response(exc, echo)
            except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too large
                response = self._error_response(_from_http_exception(exc, self.config.max_body_bytes), echo)
            except asyncio.CancelledError:
                log.info("client disconnected", route=route)
                self.metrics.requests.inc(route=route, code="499")
                raise
            except Exception:
                log.exception("request failed", route=route)
                response = self._error_response(for_status(500, "internal error"), echo)
        if not response.prepared:
            response.headers.update(echo)
        self.metrics.requests.inc(route=route, code=str(response.status))
        return response

    def _error_response(self, error: ApiError, echo: dict[str, str]) -> web.Response:
        if error.status >= 500:
            log.warning("request failed", status=error.status, error=error.message)
        else:
            log.info("request refused", status=error.status, error=error.message, param=error.param)
        return web.json_response(error.body(), status=error.status, headers={**error.headers, **echo})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        chat = parse_chat_request(body)
        return await self._generate(request, chat, "chatcmpl-")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        completion = parse_completion_request(body)
        return await self._generate(request, completion, "cmpl-")

    async def _generate(
        self, request: web.Request, parsed: ChatRequest | CompletionRequest, id_prefix: str
    ) -> web.StreamResponse:
        start = time.monotonic()
        options = parsed.options
        if options.model != self.model.name:
            message = f"the model {options.model!r} does not exist; this server serves {self.model.name!r}"
            raise ApiError(404, message, "invalid_request_error", "model", "model_not_found")
        prepared = await asyncio.to_thread(self._prepare, parsed)  # tokenizing a long prompt takes a while
        request_id = request[REQUEST_ID]
        if request_id in self.active_request_ids:
            raise bad_request(f"request id {request_id!r} is already in flight", code="duplicate_request_id")
        submit = SubmitRequest(
            request_id, prepared.prompt_ids, prepared.block_hashes, prepared.sampling, time.time(),
            ttft_slo_s=options.slo_ttft_ms / 1000 if options.slo_ttft_ms else None,
            tbt_slo_s=options.slo_tbt_ms / 1000 if options.slo_tbt_ms else None,
        )
        meta = ResponseMeta(id_prefix + request_id, int(time.time()), self.model.name, isinstance(parsed, ChatRequest))
        headers = {REQUEST_ID_HEADER: request_id}
        log.info("submitting", num_prompt_tokens=len(prepared.prompt_ids), stream=options.stream)
        self.active_request_ids.add(request_id)
        self.metrics.in_flight.inc()
        try:
            timer = RequestTimer(self.metrics, start)
            async with Session(self.backend, submit, self.config.request_timeout_s, timer) as session:
                if options.stream:
                    return await stream_answer(request, session, meta, options.include_usage, headers)
                return await whole_answer(session, meta, headers)
        finally:
            self.active_request_ids.discard(request_id)
            self.metrics.in_flight.inc(-1)

    def _prepare(self, parsed: ChatRequest | CompletionRequest) -> PreparedPrompt:
        if isinstance(parsed, ChatRequest):
            return self.prompts.chat(parsed)
        return self.prompts.completion(parsed)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(model_list(self.model.name, self.created))

    async def health(self, request: web.Request) -> web.Response:
        """200 when at least one instance of each role that serves is alive (prefill and decode), else 503."""
        counts = {role: self.backend.num_alive(role) for role in self.config.health_roles}
        is_ok = all(counts.values())
        body: dict[str, Any] = {"status": "ok" if is_ok else "unavailable", **counts}
        if self.model.is_simulated:
            body["simulated"] = True
        return web.json_response(body, status=200 if is_ok else 503)

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        for role in self.config.health_roles:
            self.metrics.queue_depth.set(self.backend.num_waiting(role), role=role)
        self.kv_metrics.update(self.backend.instances())
        text = self.metrics.render() + "\n".join(self.kv_metrics.render()) + "\n"
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


def _from_http_exception(exc: web.HTTPException, max_body_bytes: int) -> ApiError:
    if exc.status == 404:
        return for_status(404, "no such route; try /v1/chat/completions, /v1/completions or /v1/models")
    if exc.status == 405:
        error = for_status(405, f"method not allowed; allowed: {exc.headers.get('Allow', '')}")
        error.headers["Allow"] = exc.headers.get("Allow", "")
        return error
    if exc.status == 413:
        return for_status(413, f"the request body is larger than {max_body_bytes} bytes")
    return for_status(exc.status, exc.reason)
