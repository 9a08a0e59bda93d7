"""Structured logging for every service: structlog, one JSON object per line on stderr (or console for people).

Per-request lines carry `request_id` (bound by the handler); every line carries `service` and `instance`. No line
carries a credential: passwords in URLs and every value registered with `keep_secret` are masked on the way out.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:,]*):[^/@\s,]*@")
_URL_TOKEN = re.compile(r"(?P<head>(?:nats|tls|ws|wss)://)[^/@\s:,]+@")  # nats://<token>@host
MASK = "***"
_SECRETS: set[str] = set()  # values no line may show (the process's NATS password, say)


def redact_url(text: str) -> str:
    """`text` with the password of every `scheme://user:password@` in it masked (comma-separated URLs too), and a
    NATS URL's token (`nats://<token>@host`)."""
    text = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}:{MASK}@", text)
    return _URL_TOKEN.sub(lambda m: f"{m.group('head')}{MASK}@", text)


def keep_secret(value: str) -> None:
    """Mask `value` wherever it would appear in a log line of this process from now on (8 characters or more)."""
    if len(value) >= 8:
        _SECRETS.add(value)


def redact(text: str) -> str:
    """`text` with URL passwords and the values given to `keep_secret` masked."""
    for secret in _SECRETS:
        text = text.replace(secret, MASK)
    return redact_url(text)


def _redact_event(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = redact(value)
    return event


class _RedactingFilter(logging.Filter):
    """The same masking for the stdlib loggers (nats and aiohttp log through them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact(record.getMessage())
        record.args = ()
        return True


def configure_logging(service: str, instance_id: str, level: str = "info", log_format: str = "json",
                      stream: TextIO | None = None) -> None:
    """Route structlog (and the stdlib loggers of aiohttp and nats) to `stream` (stderr) as JSON lines."""
    stream = stream or sys.stderr
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if log_format == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _redact_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, instance=instance_id)
    logging.basicConfig(level=max(_LEVELS[level], logging.WARNING), stream=stream, format="%(name)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_RedactingFilter())


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
