"""Turn a `Session`'s deltas into an HTTP answer: one JSON body, or server-sent events ending in `[DONE]`.

A failure before the first output token is a plain HTTP error (raised); after it, an SSE error event.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway.errors import ApiError
from services.gateway.responses import DONE, ResponseMeta, chunk, completion, sse, usage, usage_chunk
from services.gateway.session import Delta, Session
from shared.wire.log import get_logger

log = get_logger(__name__)


def _usage(session: Session) -> dict[str, Any]:
    return usage(session.num_prompt_tokens, session.num_output_tokens, session.num_cached_tokens,
                 session.kv_bytes_saved)


async def whole_answer(session: Session, meta: ResponseMeta, headers: dict[str, str]) -> web.Response:
    """Collect every delta into one `chat.completion` / `text_completion`. Raises ApiError on a failure."""
    texts = []
    while True:
        delta = await session.next_delta()
        texts.append(delta.text)
        if delta.finish_reason:
            break
    body = completion(meta, "".join(texts), delta.finish_reason, _usage(session))
    return web.json_response(body, headers=headers)


async def stream_answer(
    request: web.Request, session: Session, meta: ResponseMeta, include_usage: bool, headers: dict[str, str]
) -> web.StreamResponse:
    """Stream chunks: (chat) the role chunk, one chunk per event (the last one carries `finish_reason`), the
    usage chunk when asked for, `[DONE]`.

    Raises:
        ApiError: the request failed before its first output, so the status can still say so.
    """
    delta = await session.next_delta()  # the headers wait for the first output: early failures keep a status
    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
        if meta.is_chat:
            await response.write(sse(chunk(meta, "", None, with_role=True, with_usage=include_usage)))
        while True:
            await response.write(sse(chunk(meta, delta.text, delta.finish_reason, with_usage=include_usage)))
            if delta.finish_reason:
                break
            next_delta = await _next_or_error(session, response)
            if next_delta is None:
                break
            delta = next_delta
        if include_usage and session.is_done:
            await response.write(sse(usage_chunk(meta, _usage(session))))
        await response.write(DONE)
        await response.write_eof()
    except ConnectionError:
        log.info("client disconnected", request_id=session.request_id)
        session.cancel_reason = "client disconnected"
    return response


async def _next_or_error(session: Session, response: web.StreamResponse) -> Delta | None:
    """The next delta, or None after writing the failure as an SSE error event."""
    try:
        return await session.next_delta()
    except ApiError as exc:
        await response.write(sse(exc.body()))
        return None
