"""The gateway's HTTP side: aiohttp routes (OpenAI API, models, health, liveness, metrics, the OpenAPI document) and
the middleware that gives every request its identity, checks its API key, and answers every failure with a JSON error
body and a metrics count. The cluster is behind `Backend`; the HTTP server itself is http_server.py's.
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

from services.gateway.auth import authenticate, needs_key
from services.gateway.backend import ROLES_FOR_HEALTH, Backend
from services.gateway.errors import ApiError, for_status
from services.gateway.identity import REQUEST_ID_HEADER, RequestIdentity, identify
from services.gateway.json_body import parse_json_object, read_body
from services.gateway.kv_metrics import KvMetrics
from services.gateway.limits import KeyLimits, Ticket
from services.gateway.metrics import CONTENT_TYPE, GatewayMetrics, RequestTimer
from services.gateway.openai_api import ChatRequest, CompletionRequest, parse_chat_request, parse_completion_request
from services.gateway.openapi import openapi_document
from services.gateway.prompt import ModelInfo, PreparedPrompt, PromptBuilder
from services.gateway.responses import ResponseMeta, model_card, model_list
from services.gateway.session import Deadlines, Session
from services.gateway.streaming import stream_answer, whole_answer
from shared.wire.api_keys import ApiKey, ApiKeys
from shared.wire.log import get_logger
from shared.wire.protocol import Role, SubmitRequest

log = get_logger(__name__)
IDENTITY = web.RequestKey("identity", RequestIdentity)
API_KEY = web.RequestKey("api_key", ApiKey)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Parser = Callable[[dict[str, Any]], ChatRequest | CompletionRequest]


@dataclass(frozen=True)
class GatewayConfig:
    """HTTP-side settings (from `GatewaySettings`: block_size, request_timeout_s, max_body_bytes, progress_timeout_s,
    http_read_timeout_s, migration_limit, scheduler_wait_s, and the keys of TSUKIMI_API_KEYS_FILE; None: no keys
    needed).
    `health_roles` from the deployment: a colocated one has no prefill pool."""

    block_size: int = 64
    request_timeout_s: float = 300.0
    max_body_bytes: int = 1 << 20
    health_roles: tuple[str, ...] = ROLES_FOR_HEALTH
    progress_timeout_s: float = 15.0
    http_read_timeout_s: float = 30.0
    api_keys: ApiKeys | None = None
    migration_limit: int = 3
    scheduler_wait_s: float = 0.0


class Gateway:
    """The gateway's state: the model's tokenizer and limits, the backend, metrics, key limits, requests in flight.

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
        self.limits = KeyLimits()
        self.active_request_ids: set[str] = set()
        self.created = int(time.time())
        self.document = openapi_document(model.name, has_keys=config.api_keys is not None)

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._middleware])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model_card)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        identity, refusal = _identify(request.headers.get(REQUEST_ID_HEADER))
        echo = {REQUEST_ID_HEADER: identity.echo} if refusal is None else {}
        request[IDENTITY] = identity
        with structlog.contextvars.bound_contextvars(**identity.log_fields()):
            try:
                if refusal is not None:
                    raise refusal
                response = await self._authorized(request, handler)
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

    async def _authorized(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Run the handler once the caller's key checks out (where the path needs one and keys are configured)."""
        key = None
        if needs_key(request.path):
            key = authenticate(self.config.api_keys, request.headers.get("Authorization"))
        if key is None:
            return await handler(request)
        request[API_KEY] = key
        with structlog.contextvars.bound_contextvars(api_key=key.name):
            return await handler(request)

    def _error_response(self, error: ApiError, echo: dict[str, str]) -> web.Response:
        if error.status >= 500:
            log.warning("request failed", status=error.status, error=error.message)
        else:
            log.info("request refused", status=error.status, error=error.message, param=error.param)
        response = web.json_response(error.body(), status=error.status, headers={**error.headers, **echo})
        if error.status == 408:
            response.force_close()  # the rest of a late body may still be on its way
        return response

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat_request, "chatcmpl-")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion_request, "cmpl-")

    async def _generate(self, request: web.Request, parse: Parser, id_prefix: str) -> web.StreamResponse:
        """Admit (key limits), read and parse the body, tokenize, reserve the key's tokens, then answer."""
        key = request.get(API_KEY)
        ticket = self.limits.admit(key) if key is not None else None
        session: Session | None = None
        try:
            parsed = parse(parse_json_object(await read_body(request, self.config.http_read_timeout_s)))
            self._check_model(parsed.options.model)
            prepared = await asyncio.to_thread(self._prepare, parsed)  # tokenizing a long prompt takes a while
            if ticket is not None:
                self.limits.reserve_tokens(ticket, len(prepared.prompt_ids) + prepared.sampling.max_tokens)
            session = self._session(request[IDENTITY], parsed, prepared)
            return await self._answer(request, session, parsed, id_prefix)
        finally:
            if ticket is not None:
                self._settle(ticket, session)

    def _check_model(self, model: str) -> None:
        if model != self.model.name:
            message = f"the model {model!r} does not exist; this server serves {self.model.name!r}"
            raise ApiError(404, message, "invalid_request_error", "model", "model_not_found")

    def _session(
        self, identity: RequestIdentity, parsed: ChatRequest | CompletionRequest, prepared: PreparedPrompt
    ) -> Session:
        options = parsed.options
        submit = SubmitRequest(
            identity.request_id, prepared.prompt_ids, prepared.block_hashes, prepared.sampling, time.time(),
            ttft_slo_s=options.slo_ttft_ms / 1000 if options.slo_ttft_ms else None,
            tbt_slo_s=options.slo_tbt_ms / 1000 if options.slo_tbt_ms else None,
        )
        deadlines = Deadlines(self.config.request_timeout_s, self.config.progress_timeout_s,
                              self.config.scheduler_wait_s)
        return Session(self.backend, submit, deadlines, RequestTimer(self.metrics, time.monotonic()),
                       self.config.migration_limit, self.prompts.hashes)

    async def _answer(
        self, request: web.Request, session: Session, parsed: ChatRequest | CompletionRequest, id_prefix: str
    ) -> web.StreamResponse:
        identity, options = request[IDENTITY], parsed.options
        meta = ResponseMeta(id_prefix + identity.request_id, int(time.time()), self.model.name,
                            isinstance(parsed, ChatRequest))
        headers = {REQUEST_ID_HEADER: identity.echo}
        log.info("submitting", num_prompt_tokens=session.num_prompt_tokens, stream=options.stream)
        self.active_request_ids.add(identity.request_id)
        self.metrics.in_flight.inc()
        try:
            async with session:
                if options.stream:
                    return await stream_answer(request, session, meta, options.include_usage, headers)
                return await whole_answer(session, meta, headers)
        finally:
            self.active_request_ids.discard(identity.request_id)
            self.metrics.in_flight.inc(-1)

    def _settle(self, ticket: Ticket, session: Session | None) -> None:
        """Give the key back the tokens it reserved but did not use (all of them when the request never ran)."""
        used = 0
        if session is not None and session.is_accepted:
            used = session.num_prompt_tokens + session.num_output_tokens
        self.limits.finish(ticket, used)

    def _prepare(self, parsed: ChatRequest | CompletionRequest) -> PreparedPrompt:
        if isinstance(parsed, ChatRequest):
            return self.prompts.chat(parsed)
        return self.prompts.completion(parsed)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(model_list(self.model.name, self.created))

    async def model_card(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.model.name:
            message = f"the model {model_id!r} does not exist; this server serves {self.model.name!r}"
            raise ApiError(404, message, "invalid_request_error", "model", "model_not_found")
        return web.json_response(model_card(self.model.name, self.created))

    async def health(self, request: web.Request) -> web.Response:
        """200 when a scheduler and an instance of each role that serves are alive (prefill and decode), else 503
        naming what is missing."""
        counts = {role: self.backend.num_alive(role) for role in self.config.health_roles}
        missing = [role for role, count in counts.items() if not count]
        body: dict[str, Any] = {"status": "unavailable" if missing else "ok", **counts}
        if missing:
            body["missing"] = missing
            body["message"] = f"no live {', '.join(missing)} instance"
        if self.model.is_simulated:
            body["simulated"] = True
        return web.json_response(body, status=503 if missing else 200, headers={"Retry-After": "1"} if missing else {})

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        for role in self.config.health_roles:
            if role != Role.SCHEDULER:
                self.metrics.queue_depth.set(self.backend.num_waiting(role), role=role)
        self.kv_metrics.update(self.backend.instances())
        text = self.metrics.render() + "\n".join(self.kv_metrics.render()) + "\n"
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self.document)


def _identify(label: str | None) -> tuple[RequestIdentity, ApiError | None]:
    """The request's identity; with a malformed label, a fresh one (for the logs) and the 400 to answer."""
    try:
        return identify(label), None
    except ApiError as exc:
        return RequestIdentity(uuid.uuid4().hex), exc


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
