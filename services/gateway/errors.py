"""OpenAI-style API errors: the `{"error": {message, type, param, code}}` body and the HTTP status of each failure.

Owns the mapping from `shared.wire.protocol.ErrorType` (and bus failures) to statuses; not the routes that raise them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shared.wire.protocol import ErrorType

INVALID_REQUEST = "invalid_request_error"


@dataclass
class ApiError(Exception):
    """A failure the client sees as an HTTP status with an OpenAI error object.

    Args:
        status: the HTTP status.
        message: what went wrong, for people.
        type: the OpenAI error type (`invalid_request_error`, `rate_limit_error`, ...).
        param: the offending request field, when there is one.
        code: a machine-readable code (`model_not_found`, `context_length_exceeded`, ...).
        headers: extra response headers (`Retry-After` on 429 and 503, `WWW-Authenticate` on 401).
    """

    status: int
    message: str
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.message}"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, INVALID_REQUEST, param, code)


_BY_STATUS: dict[int, tuple[str, str]] = {
    400: (INVALID_REQUEST, "invalid_request"),
    401: (INVALID_REQUEST, "invalid_api_key"),
    404: (INVALID_REQUEST, "not_found"),
    405: (INVALID_REQUEST, "method_not_allowed"),
    408: (INVALID_REQUEST, "request_timeout"),
    413: (INVALID_REQUEST, "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal"),
    502: ("server_error", "kv_transfer"),
    503: ("service_unavailable_error", "unavailable"),
    504: ("timeout_error", "timeout"),
}


def for_status(status: int, message: str, retry_after_s: float = 1.0) -> ApiError:
    """An error of `status` with that status's usual type and code (used for aiohttp's own HTTP errors); a 429 or
    503 says when to retry (`Retry-After`: whole seconds, at least 1, at most an hour)."""
    error_type, code = _BY_STATUS.get(status, (INVALID_REQUEST if status < 500 else "server_error", None))
    error = ApiError(status, message, error_type, None, code)
    if status in (429, 503):
        seconds = min(retry_after_s, 3600.0) if math.isfinite(retry_after_s) else 1.0
        error.headers["Retry-After"] = str(max(1, math.ceil(seconds)))
    return error


_STATUS_OF_ERROR_TYPE = {
    ErrorType.REJECTED: 429,
    ErrorType.UNAVAILABLE: 503,
    ErrorType.KV_TRANSFER: 502,
    ErrorType.INVALID: 400,
    ErrorType.INTERNAL: 500,
}


def from_error_type(error_type: str, message: str, retry_after_s: float = 0.0) -> ApiError:
    """The API error for a failure the scheduler or an instance reported (an `ErrorType` value).

    Unknown types count as internal errors. A rejection or an unavailable cluster carries `Retry-After`.
    """
    try:
        status = _STATUS_OF_ERROR_TYPE[ErrorType(error_type)]
    except ValueError:
        status = 500
    return for_status(status, message or f"request failed: {error_type or 'unknown error'}", retry_after_s)


def unavailable(message: str) -> ApiError:
    return for_status(503, message)


def unauthorized(message: str) -> ApiError:
    error = for_status(401, message)
    error.headers["WWW-Authenticate"] = 'Bearer realm="tsukimi"'
    return error


def rate_limited(message: str, retry_after_s: float) -> ApiError:
    return for_status(429, message, retry_after_s)


def timed_out(timeout_s: float) -> ApiError:
    return for_status(504, f"no progress on the request for {timeout_s:g} s")
