"""The JSON shapes the gateway answers with, as in the official openai-python types (`ChatCompletion`,
`ChatCompletionChunk`, `Completion`, `CompletionUsage`, `Model`), and their SSE framing. No I/O here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response repeats.

    Args:
        id: `chatcmpl-<request id>` or `cmpl-<request id>`.
        created: unix seconds when the request arrived.
        model: the model id.
        is_chat: chat completions (else text completions).
    """

    id: str
    created: int
    model: str
    is_chat: bool


def usage(
    num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int, kv_bytes_saved: int = 0
) -> dict[str, Any]:
    """OpenAI's `CompletionUsage`; with FastGen (`kv_bytes_saved` > 0) also tsukimi's `kv_bytes_saved`: the KV bytes
    the request did not hold at its end, against keeping every token."""
    figures: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }
    if kv_bytes_saved:
        figures["kv_bytes_saved"] = kv_bytes_saved
    return figures


def completion(meta: ResponseMeta, text: str, finish_reason: str, usage_: dict[str, Any]) -> dict[str, Any]:
    """The whole (non-streaming) answer: a `chat.completion` or a `text_completion`."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if meta.is_chat:
        choice["message"] = {"role": "assistant", "content": text, "refusal": None}
    else:
        choice["text"] = text
    return {**_head(meta, chunk=False), "choices": [choice], "usage": usage_}


def chunk(
    meta: ResponseMeta, text: str, finish_reason: str | None, with_role: bool = False, with_usage: bool = False
) -> dict[str, Any]:
    """One streamed piece: `delta.content` (chat) or `text` (completions); `with_role` adds the assistant role.

    With `with_usage` (the client asked for `stream_options.include_usage`) the chunk has `"usage": null`, as
    OpenAI sends on every chunk but the last.
    """
    choice: dict[str, Any] = {"index": 0}
    if meta.is_chat:
        choice["delta"] = {"role": "assistant", "content": text} if with_role else {"content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    out = {**_head(meta, chunk=True), "choices": [choice]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(meta: ResponseMeta, usage_: dict[str, Any]) -> dict[str, Any]:
    """The last chunk when the client asked for usage: no choices."""
    return {**_head(meta, chunk=True), "choices": [], "usage": usage_}


def model_card(model: str, created: int) -> dict[str, Any]:
    """OpenAI's `Model`."""
    return {"id": model, "object": "model", "created": created, "owned_by": "tsukimi"}


def model_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created)]}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _head(meta: ResponseMeta, chunk: bool) -> dict[str, Any]:
    if meta.is_chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        kind = "text_completion"  # OpenAI names streamed completion chunks the same
    return {"id": meta.id, "object": kind, "created": meta.created, "model": meta.model}
