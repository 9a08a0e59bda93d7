"""Structured logging for every service: structlog, one JSON object per line on stderr (or console for people).

Per-request lines carry `request_id` (bound by the handler); every line carries `service` and `instance`.
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(service: str, instance_id: str, level: str = "info", log_format: str = "json") -> None:
    """Route structlog (and the stdlib loggers of aiohttp and nats) to stderr as JSON lines."""
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if log_format == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, instance=instance_id)
    logging.basicConfig(level=max(_LEVELS[level], logging.WARNING), stream=sys.stderr, format="%(name)s %(message)s")


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
