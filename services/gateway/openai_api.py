"""Parse and validate OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) into typed requests.

Types are checked strictly (a bool is not an int); unknown fields are ignored, as OpenAI clients send many, but an
OpenAI field this server cannot honour (tools, response formats, penalties, logprobs, ...) is refused (400) unless it
asks for nothing. `temperature` and `top_p` are held to OpenAI's ranges; the other sampling ranges are checked by
`SamplingParams`, the one sampling type from here to the engine, whose errors name their field. Reading the body is
json_body.py's job; tokenization is not done here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import bad_request
from shared.wire.protocol import SamplingError, SamplingParams

MAX_STOP_STRINGS = 4
# Without max_tokens a request generates up to this many tokens (never past the context window): filling the
# whole window by default would let one forgetful client hold a decode slot for thousands of tokens.
DEFAULT_MAX_TOKENS = 512
_INT64 = 1 << 63
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields we cannot honour -> the values that ask for nothing we lack (null always does). vLLM's extensions too.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "logit_bias": ({},), "top_logprobs": (0,),
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
    "audio": (), "modalities": (["text"],), "prediction": (), "web_search_options": (), "reasoning_effort": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "use_beam_search": (False,),
}
_CHAT_NEUTRAL = {**_NEUTRAL, "logprobs": (False,)}
_COMPLETION_NEUTRAL = {**_NEUTRAL, "logprobs": (), "echo": (False,), "best_of": (1,), "suffix": ("",)}


@dataclass(frozen=True)
class GenerationOptions:
    """What both endpoints share: the model, how much to generate, sampling, and streaming.

    `max_tokens` is None when the client gave neither `max_tokens` nor `max_completion_tokens`; `sampling` then
    holds DEFAULT_MAX_TOKENS, which the prompt's room may lower (prompt.py).
    """

    model: str
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=DEFAULT_MAX_TOKENS))
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


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Validate a chat completions body. Raises ApiError (400) naming the offending field."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    parsed = [_parse_message(m, i) for i, m in enumerate(messages)]
    options = parse_options(body)
    _reject_unsupported(body, _CHAT_NEUTRAL)
    return ChatRequest(parsed, options)


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    """Validate a completions body. Raises ApiError (400) naming the offending field."""
    options = parse_options(body)
    _reject_unsupported(body, _COMPLETION_NEUTRAL)
    return CompletionRequest(_parse_prompt(body.get("prompt")), options)


def parse_options(body: dict[str, Any]) -> GenerationOptions:
    """The fields both endpoints share. Raises ApiError (400)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "model")
    n = _int(body, "n", 1, _INT64 - 1)
    if n not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    legacy_max_tokens = _int(body, "max_tokens", 1, _INT64 - 1)  # checked even when the newer name wins
    max_tokens = _int(body, "max_completion_tokens", 1, _INT64 - 1)
    if max_tokens is None:
        max_tokens = legacy_max_tokens
    top_k = _int(body, "top_k", -1, _INT64 - 1)
    stream = _bool(body, "stream") or False
    try:
        sampling = SamplingParams(
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            temperature=_number_in(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number_in(body, "top_p", 1.0, 0.0, 1.0, open_below=True),
            top_k=0 if top_k is None or top_k == -1 else top_k,  # -1 disables top-k, as in vLLM
            seed=_int(body, "seed", -_INT64, (1 << 64) - 1),
            stop=_parse_stop(body.get("stop")),
            ignore_eos=_bool(body, "ignore_eos") or False,
            min_tokens=_int(body, "min_tokens", 0, _INT64 - 1) or 0,
        )
    except SamplingError as exc:
        raise bad_request(str(exc), exc.field) from None
    return GenerationOptions(
        model=model,
        max_tokens=max_tokens,
        sampling=sampling,
        stream=stream,
        include_usage=_parse_stream_options(body.get("stream_options"), stream),
        slo_ttft_ms=_positive_or_none(body, "slo_ttft_ms"),
        slo_tbt_ms=_positive_or_none(body, "slo_tbt_ms"),
    )


MIN_SLO_MS = 1.0  # an SLO tighter than a millisecond is no SLO a step can meet (and 5e-324 ms is 0 s)


def _positive_or_none(body: dict[str, Any], name: str) -> float | None:
    if body.get(name) is None:
        return None
    value = _number(body, name, 0.0)
    if not value >= MIN_SLO_MS:
        raise bad_request(f"'{name}' must be at least {MIN_SLO_MS:g} ms, got {value}", name)
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
    if isinstance(prompt, list) and prompt and _are_token_ids(prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad_request("only one prompt per request is supported", "prompt")
    raise bad_request("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def _are_token_ids(values: list[Any]) -> bool:
    """Every value an int (not a bool) in [0, 2**32): one pass in C per check, as a prompt may hold 100k ids."""
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) < 1 << 32


def _parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return list(stops)


def _parse_stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return _bool(options, "include_usage", "stream_options.include_usage") or False


def _reject_unsupported(body: dict[str, Any], neutral: dict[str, tuple[Any, ...]]) -> None:
    """Fields we cannot honour: accepted only when absent, null or one of their neutral values (of the same type:
    `false` is not 0)."""
    for name, accepted in neutral.items():
        value = body.get(name)
        if value is None or any(_same(value, a) for a in accepted):
            continue
        allowed = " or ".join([*(json.dumps(a) for a in accepted), "null"])
        raise bad_request(f"'{name}' is not supported by this server (only {allowed})", name)


def _same(value: Any, neutral: Any) -> bool:
    if _is_number(value) and _is_number(neutral):
        return bool(value == neutral)
    return type(value) is type(neutral) and bool(value == neutral)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """A value for an error message: scalars as JSON (shortened), containers by kind (they may nest deep)."""
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "a list"
    return json.dumps(value)[:40]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str, minimum: int, maximum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {_show(value)}", name)
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
        raise bad_request(f"'{name}' must be a finite number, got {_show(value)}", name)
    return number


def _number_in(
    body: dict[str, Any], name: str, default: float, low: float, high: float, open_below: bool = False
) -> float:
    number = _number(body, name, default)
    if number > high or number < low or (open_below and number == low):
        interval = f"({low:g}, {high:g}]" if open_below else f"[{low:g}, {high:g}]"
        raise bad_request(f"'{name}' must be in {interval}, got {number:g}", name)
    return number


def _bool(body: dict[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {_show(value)}", param or name)
    return value
