"""Reading a request body: within a deadline, as strict UTF-8 JSON holding one object whose every string is valid
Unicode. Everything malformed is a 400 (or 408, 413) here, before any field is looked at (openai_api.py's job).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from aiohttp import web

from services.gateway.errors import bad_request, for_status


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body. Raises ApiError: 408 when it takes longer than `timeout_s` (the app then closes the
    connection), 400 when it breaks off or is malformed (chunks, encoding); 413 comes as aiohttp's
    HTTPRequestEntityTooLarge."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise for_status(408, f"the request body did not arrive within {timeout_s:g} s") from None
    except web.RequestPayloadError as exc:
        raise bad_request(f"the request body is malformed: {exc}") from None


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object.

    Raises:
        ApiError: (400) not UTF-8, not JSON (NaN and Infinity are not JSON either), nested too deep, another JSON
            value than an object, or a string holding a lone surrogate (`"\\ud800"`), which no text can encode.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the body is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("the body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and integers too long to convert
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request(f"the body must be a JSON object, got {type(value).__name__}")
    where = _first_unencodable(value) if _MAY_HOLD_SURROGATE.search(text) else None
    if where is not None:
        raise bad_request(f"{where or 'the body'} holds a lone UTF-16 surrogate, which is not text", where or None)
    return value


# Valid UTF-8 cannot carry a surrogate, so a decoded string holds one only from a `\uD800`-`\uDFFF` escape; a body
# without one (a long prompt of token ids, say) skips the walk over every value. `\\ud800` matches too: walked.
_MAY_HOLD_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON value")


def _first_unencodable(value: Any) -> str | None:
    """The path (`messages[0].content`; "" for the top) of a string or key that is not valid Unicode, else None."""
    stack: list[tuple[Any, str, str | int]] = [(value, "", "")]  # (value, its parent's path, its key or index)
    while stack:  # not recursive: JSON nests up to the interpreter's recursion limit
        item, parent, key = stack.pop()
        if isinstance(item, str) and not _is_encodable(item):
            return _path(parent, key)
        if isinstance(item, dict):
            path = _path(parent, key)
            for name, child in item.items():
                if not _is_encodable(name):
                    return path
                stack.append((child, path, name))
        elif isinstance(item, list):
            path = _path(parent, key)
            stack.extend((child, path, i) for i, child in enumerate(item))
    return None


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
