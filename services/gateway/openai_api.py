"""Parse and validate OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) into typed requests.

Types are checked strictly (a bool is not an int); unknown fields are ignored, as OpenAI clients send many.
Sampling ranges are checked by `SamplingParams` later (prompt.py), not here; tokenization is not done here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import bad_request

MAX_STOP_STRINGS = 4
_INT64 = 1 << 63
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class GenerationOptions:
    """What both endpoints share: the model, how much to generate, sampling, and streaming.

    `max_tokens` is None when the client gave neither `max_tokens` nor `max_completion_tokens`.
    """

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    include_usage: bool = False
    # tsukimi extensions: a request may tighten the server's SLOs (it can never loosen them).
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]  # {"role": system|user|assistant, "content": text}
    options: GenerationOptions


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]  # text, or token ids used as they are
    options: GenerationOptions


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object. Raises ApiError (400) for malformed JSON or another JSON value."""
    try:
        value = json.loads(body)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request(f"the body must be a JSON object, got {type(value).__name__}")
    return value


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Validate a chat completions body. Raises ApiError (400) naming the offending field."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    return ChatRequest([_parse_message(m, i) for i, m in enumerate(messages)], parse_options(body))


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    """Validate a completions body. Raises ApiError (400) naming the offending field."""
    options = parse_options(body)
    _reject_unsupported(body, {"echo": False, "best_of": 1, "suffix": None})
    return CompletionRequest(_parse_prompt(body.get("prompt")), options)


def parse_options(body: dict[str, Any]) -> GenerationOptions:
    """The fields both endpoints share. Raises ApiError (400)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "model")
    n = _int(body, "n", 1, _INT64 - 1)
    if n not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    _reject_unsupported(body, {"logprobs": None, "top_logprobs": None})
    max_tokens = _int(body, "max_completion_tokens", 1, _INT64 - 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, _INT64 - 1)
    top_k = _int(body, "top_k", -1, _INT64 - 1)
    stream = _bool(body, "stream") or False
    return GenerationOptions(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=0 if top_k is None or top_k == -1 else top_k,  # -1 disables top-k, as in vLLM
        seed=_int(body, "seed", -_INT64, (1 << 64) - 1),
        stop=_parse_stop(body.get("stop")),
        ignore_eos=_bool(body, "ignore_eos") or False,
        min_tokens=_int(body, "min_tokens", 0, _INT64 - 1) or 0,
        stream=stream,
        include_usage=_parse_stream_options(body.get("stream_options"), stream),
        slo_ttft_ms=_positive_or_none(body, "slo_ttft_ms"),
        slo_tbt_ms=_positive_or_none(body, "slo_tbt_ms"),
    )


def _positive_or_none(body: dict[str, Any], name: str) -> float | None:
    if body.get(name) is None:
        return None
    value = _number(body, name, 0.0)
    if value <= 0:
        raise bad_request(f"'{name}' must be a positive number of milliseconds, got {value}", name)
    return value


def _parse_message(message: Any, i: int) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if role not in _CHAT_ROLES:
        roles = ", ".join(_CHAT_ROLES)
        raise bad_request(f"{where}.role must be one of {roles}, got {role!r}", f"{where}.role")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""  # an assistant turn that only called tools; we keep its (empty) text
    return {"role": _CHAT_ROLES[role], "content": _parse_content(content, f"{where}.content")}


def _parse_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}[{j}]: only parts of type 'text' are supported, got {kind!r}", f"{where}[{j}]")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
        texts.append(text)
    return "\n".join(texts)  # as vLLM joins text parts


def _parse_prompt(prompt: Any) -> str | list[int]:
    # A batch of one (["text"] or [[ids]]) is the same as its single prompt.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and 0 <= t < 1 << 32 for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad_request("only one prompt per request is supported", "prompt")
    raise bad_request("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def _parse_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _parse_stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return _bool(options, "include_usage", "stream_options.include_usage") or False


def _reject_unsupported(body: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Fields we cannot honour: accepted only when absent, null, false, zero, empty or their default."""
    for name, default in defaults.items():
        value = body.get(name)
        if value and value != default:
            raise bad_request(f"'{name}' is not supported", name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str, minimum: int, maximum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {json.dumps(value)[:40]}", name)
    if not minimum <= value <= maximum:
        raise bad_request(f"'{name}' must be in [{minimum}, {maximum}], got {value}", name)
    return int(value)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    try:
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise bad_request(f"'{name}' must be a finite number, got {json.dumps(value)[:40]}", name)
    return number


def _bool(body: dict[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {json.dumps(value)[:40]}", param or name)
    return value
