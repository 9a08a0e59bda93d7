"""The JSON Schemas of the OpenAPI document (openapi.py): request bodies as openai_api.py parses them, answers as
responses.py builds them, errors as errors.py writes them.

What a schema cannot say is in its description: the prompt plus `max_tokens` must fit the context, `min_tokens` may
not exceed `max_tokens`, and `stream_options` needs `stream`; the gateway answers 400 for those.
"""

from __future__ import annotations

from typing import Any

INT64_MAX = (1 << 63) - 1
JSON_TYPE = "application/json"
_NULL = {"type": "null"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, _NULL]}


def _only(*values: Any) -> dict[str, Any]:
    """A field this server cannot honour: only the values that ask for nothing, or null."""
    return {"enum": [*values, None], "description": "not supported: only these values"}


def _options(model: str) -> dict[str, Any]:
    """Fields both endpoints take (openai_api.parse_options)."""
    return {
        "model": {"type": "string", "enum": [model], "description": "the served model (another id: 404)"},
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": INT64_MAX}),
        "max_completion_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": INT64_MAX}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": INT64_MAX}),
        "seed": _nullable({"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 64) - 1}),
        "stop": {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}, _NULL]},
        "n": _only(1),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "description": "only with stream: true",
                                     "properties": {"include_usage": _nullable({"type": "boolean"})}}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0, "maximum": INT64_MAX,
                                 "description": "at most max_tokens"}),
        "slo_ttft_ms": _nullable({"type": "number", "minimum": 1, "description": "tightens the TTFT SLO (ms)"}),
        "slo_tbt_ms": _nullable({"type": "number", "minimum": 1, "description": "tightens the TBT SLO (ms)"}),
        "tools": _nullable({"type": "array", "maxItems": 0}), "functions": _nullable({"type": "array", "maxItems": 0}),
        "tool_choice": _only("none"), "function_call": _only("none"),
        "response_format": _nullable({"type": "object", "required": ["type"], "additionalProperties": False,
                                      "properties": {"type": {"const": "text"}}}),
        "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
        "top_logprobs": _only(0), "frequency_penalty": _only(0), "presence_penalty": _only(0),
    }


def _chat_request(model: str) -> dict[str, Any]:
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}, _NULL]}
    message = {
        "type": "object", "required": ["role"],
        "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]}, "content": content},
        # only an assistant turn may leave its content out or null
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"], "properties": {"content": {"not": _NULL}}},
    }
    return {
        "type": "object", "required": ["model", "messages"],
        "description": "the templated messages plus max_tokens must fit the context (else 400)",
        "properties": {"messages": {"type": "array", "minItems": 1, "items": message}, **_options(model),
                       "logprobs": _only(False)},
    }


def _completion_request(model: str) -> dict[str, Any]:
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1},
                 "description": "token ids below the vocabulary size"}
    text = {"type": "string", "minLength": 1}
    prompt = {"anyOf": [text, token_ids, {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
                        {"type": "array", "items": token_ids, "minItems": 1, "maxItems": 1}]}
    return {
        "type": "object", "required": ["model", "prompt"],
        "description": "the prompt plus max_tokens must fit the context (else 400)",
        "properties": {"prompt": prompt, **_options(model), "logprobs": _only(), "echo": _only(False),
                       "best_of": _only(1), "suffix": _only("")},
    }


def _usage() -> dict[str, Any]:
    count = {"type": "integer", "minimum": 0}
    return {
        "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
        "properties": {
            "prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
            "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                      "properties": {"cached_tokens": count}},
            "kv_bytes_saved": {**count, "description": "FastGen: KV bytes not held at the end"},
        },
    }


def _answer(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    head = {"id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
            "model": {"type": "string"}}
    full_choice = {"type": "object", "required": ["index", "finish_reason", "logprobs", *choice],
                   "properties": {"index": {"const": 0}, "finish_reason": {"enum": ["stop", "length"]},
                                  "logprobs": _NULL, **choice}}
    return {"type": "object", "required": [*head, "choices", "usage"],
            "properties": {**head, "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": full_choice},
                           "usage": {"$ref": "#/components/schemas/Usage"}}}


def _chunk(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    """One streamed chunk (responses.chunk), or the last one with usage and no choices (responses.usage_chunk)."""
    head = {"id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
            "model": {"type": "string"}}
    streamed = {"type": "object", "required": ["index", "logprobs", "finish_reason", *choice],
                "properties": {"index": {"const": 0}, "logprobs": _NULL, **choice,
                               "finish_reason": _nullable({"enum": ["stop", "length"]})}}
    return {"type": "object", "required": [*head, "choices"],
            "properties": {**head, "choices": {"type": "array", "maxItems": 1, "items": streamed},
                           "usage": _nullable({"$ref": "#/components/schemas/Usage"})}}


def _sse_event() -> dict[str, Any]:
    """One server-sent event as OpenAPI before 3.2 describes a stream's items: its `data` is the JSON of a chunk
    (ChatCompletionChunk, CompletionChunk), of an Error (a failure after the first token), or `[DONE]`."""
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"type": "string", "contentMediaType": JSON_TYPE}, "event": {"const": "message"}}}


def component_schemas(model: str) -> dict[str, Any]:
    """Every schema the document refers to, for a gateway serving `model`."""
    message = {"type": "object", "required": ["role", "content", "refusal"],
               "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}, "refusal": _NULL}}
    model_card = {"type": "object", "required": ["id", "object", "created", "owned_by"],
                  "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                                 "owned_by": {"type": "string"}}}
    error = {"type": "object", "required": ["message", "type", "param", "code"],
             "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                            "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})}}
    return {
        "CreateChatCompletionRequest": _chat_request(model),
        "CreateCompletionRequest": _completion_request(model),
        "ChatCompletion": _answer("chat.completion", {"message": message}),
        "Completion": _answer("text_completion", {"text": {"type": "string"}}),
        "ChatCompletionChunk": _chunk("chat.completion.chunk", {"delta": {
            "type": "object", "required": ["content"],
            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}}),
        "CompletionChunk": _chunk("text_completion", {"text": {"type": "string"}}),
        "ServerSentEvent": _sse_event(),
        "Usage": _usage(),
        "Model": model_card,
        "ModelList": {"type": "object", "required": ["object", "data"],
                      "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": model_card}}},
        "Health": {"type": "object", "required": ["status"],
                   "properties": {"status": {"enum": ["ok", "unavailable"]},
                                  "missing": {"type": "array", "items": {"type": "string"}},
                                  "message": {"type": "string"}, "simulated": {"type": "boolean"}},
                   "additionalProperties": {"type": "integer", "minimum": 0,
                                            "description": "live instances of each role"}},
        "Live": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
        "Error": {"type": "object", "required": ["error"], "properties": {"error": error}},
    }
