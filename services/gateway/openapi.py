"""The OpenAPI 3.1 document of the gateway's HTTP API (`GET /openapi.json`), written by hand to say what the parsers
(openai_api.py, json_body.py) accept and what responses.py and errors.py answer; the schemathesis test holds it to the
running gateway. Schemas live in openapi_schemas.py.
"""

from __future__ import annotations

from typing import Any

from services.gateway.openapi_schemas import component_schemas

JSON = "application/json"
_ERRORS = {
    400: "a malformed body or an invalid field (`param` names it), or a prompt that does not fit the context",
    404: "another model than the one served",
    408: "the body did not arrive in time (TSUKIMI_HTTP_READ_TIMEOUT_S)",
    413: "a body larger than TSUKIMI_MAX_BODY_KB",
    429: "refused: predicted to miss the SLOs, or an API key's limit",
    500: "a bug",
    502: "the KV transfer between instances failed",
    503: "no scheduler or instance, or the request was lost",
    504: "no progress for TSUKIMI_REQUEST_TIMEOUT_S",
}
_RETRY_AFTER = {"Retry-After": {"description": "whole seconds to wait", "schema": {"type": "string",
                                                                                    "pattern": "^[0-9]+$"}}}
_REQUEST_ID = {
    "name": "X-Request-Id", "in": "header", "required": False,
    "description": "a label for the request, echoed and logged (the gateway gives the request its own id too)",
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,128}$"},
}


def openapi_document(model: str, has_keys: bool) -> dict[str, Any]:
    """The document for a gateway serving `model`; `has_keys`: /v1 needs `Authorization: Bearer <key>` (401)."""
    keyed: dict[str, Any] = {"security": [{"apiKey": []}]} if has_keys else {}
    open_: dict[str, Any] = {"security": []}
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "tsukimi", "version": "1",
                 "description": "OpenAI-compatible completions of the served model, and the gateway's health."},
        "paths": {
            "/v1/chat/completions": {"post": _generate("CreateChatCompletionRequest", "ChatCompletion", keyed,
                                                       "a chat completion: one JSON object, or server-sent events")},
            "/v1/completions": {"post": _generate("CreateCompletionRequest", "Completion", keyed,
                                                  "a text completion: one JSON object, or server-sent events")},
            "/v1/models": {"get": _get("the served model", _json_ok("ModelList"), keyed, has_keys)},
            "/v1/models/{model}": {"get": {
                **_get("one model", {**_json_ok("Model"), **_errors([404])}, keyed, has_keys),
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            }},
            "/health": {"get": _get("200 when a scheduler and every serving role have a live instance", {
                "200": {"description": "ready", "content": {JSON: {"schema": _ref("Health")}}},
                "503": {"description": "not ready: `missing` names the roles", "headers": _RETRY_AFTER,
                        "content": {JSON: {"schema": _ref("Health")}}},
            }, open_, False)},
            "/live": {"get": _get("the gateway process answers", _json_ok("Live"), open_, False)},
            "/metrics": {"get": _get("Prometheus text format 0.0.4", {"200": {
                "description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}}, open_, False)},
            "/openapi.json": {"get": _get("this document", {"200": {
                "description": "OpenAPI 3.1", "content": {JSON: {"schema": {"type": "object"}}}}}, open_, False)},
        },
        "components": {"schemas": component_schemas(model)},
    }
    if has_keys:
        document["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    return document


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_ok(schema: str) -> dict[str, Any]:
    return {"200": {"description": "OK", "content": {JSON: {"schema": _ref(schema)}}}}


def _errors(statuses: list[int]) -> dict[str, Any]:
    responses = {}
    for status in statuses:
        response: dict[str, Any] = {"description": _ERRORS.get(status, "the API key is missing or not valid"),
                                    "content": {JSON: {"schema": _ref("Error")}}}
        if status in (429, 503):
            response["headers"] = _RETRY_AFTER
        responses[str(status)] = response
    return responses


def _get(summary: str, responses: dict[str, Any], security: dict[str, Any], has_keys: bool) -> dict[str, Any]:
    return {"summary": summary, **security, "responses": {**responses, **_errors([401] if has_keys else [])}}


def _generate(request: str, answer: str, security: dict[str, Any], summary: str) -> dict[str, Any]:
    ok = {"description": "the answer (`stream`: server-sent events `data: <chunk>`, ending `data: [DONE]`)",
          "content": {JSON: {"schema": _ref(answer)}, "text/event-stream": {"schema": _ref("ServerSentEvent")}}}
    statuses = [400, *([401] if security else []), 404, 408, 413, 429, 500, 502, 503, 504]
    return {
        "summary": summary, **security, "parameters": [_REQUEST_ID],
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {"200": ok, **_errors(statuses)},
    }
