"""The gateway's pure pieces: event reordering, request parsing, error mapping, the Prometheus text format."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError, from_error_type
from services.gateway.metrics import Counter, Histogram
from services.gateway.openai_api import parse_chat_request, parse_completion_request
from services.gateway.session import MAX_BUFFERED_EVENTS, Reorderer
from shared.wire.protocol import StreamEvent


def event(index: int, num_tokens: int, finish: str | None = None, error_type: str = "") -> StreamEvent:
    return StreamEvent("r", index, list(range(index, index + num_tokens)), f"<{index}>", finish, error_type=error_type)


def test_reorderer_releases_in_index_order_and_drops_duplicates() -> None:
    r = Reorderer()
    assert r.push(event(2, 1)) == []
    assert r.push(event(3, 0, "stop")) == []  # a bare finish waits for the tokens before it
    assert r.push(event(1, 1)) == []
    assert [e.index for e in r.push(event(0, 1))] == [0, 1, 2, 3]
    assert r.push(event(1, 1)) == []  # a duplicate of released tokens
    assert r.next_index == 3


def test_reorderer_puts_tokenless_events_before_tokens_at_their_index_and_passes_failures_at_once() -> None:
    r = Reorderer()
    assert r.push(event(2, 2)) == []
    assert r.push(event(2, 0)) == []
    assert r.push(event(2, 2)) == []  # a duplicate while buffered
    released = r.push(event(0, 2))
    assert [(e.index, len(e.token_ids)) for e in released] == [(0, 2), (2, 0), (2, 2)]
    failure = event(9, 0, error_type="internal")
    assert r.push(failure) == [failure]


def test_reorderer_gives_up_on_a_gap_that_never_fills() -> None:
    r = Reorderer()
    with pytest.raises(ApiError) as raised:
        for i in range(MAX_BUFFERED_EVENTS + 1):
            r.push(event(1 + i, 1))
    assert raised.value.status == 500


def test_chat_parsing_maps_roles_and_joins_text_parts() -> None:
    chat = parse_chat_request({
        "model": "m", "top_k": -1, "stop": "END", "max_tokens": 9, "frequency_penalty": 0, "tools": [],
        "messages": [
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "name": "bot"},
        ],
    })
    assert chat.messages == [
        {"role": "system", "content": "rules"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    assert chat.options.sampling.top_k == 0 and chat.options.sampling.stop == ["END"] and chat.options.max_tokens == 9
    assert parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "max_tokens": 5, "max_completion_tokens": 7}).options.max_tokens == 7


def test_completion_prompt_forms() -> None:
    assert parse_completion_request({"model": "m", "prompt": ["text"]}).prompt == "text"
    assert parse_completion_request({"model": "m", "prompt": [[5, 6]]}).prompt == [5, 6]
    assert parse_completion_request({"model": "m", "prompt": [7], "echo": False, "best_of": 1}).prompt == [7]


@pytest.mark.parametrize(
    ("error_type", "status", "retry_after"),
    [("rejected", 429, "1"), ("unavailable", 503, "1"), ("kv_transfer", 502, None), ("invalid", 400, None),
     ("internal", 500, None), ("something-new", 500, None)],
)
def test_error_types_map_to_statuses(error_type: str, status: int, retry_after: str | None) -> None:
    error = from_error_type(error_type, "")
    assert error.status == status and error.headers.get("Retry-After") == retry_after
    assert error.body()["error"]["message"]


def test_retry_after_is_whole_seconds_and_bounded() -> None:
    assert from_error_type("rejected", "x", 0.2).headers["Retry-After"] == "1"
    assert from_error_type("rejected", "x", 4.01).headers["Retry-After"] == "5"
    assert from_error_type("rejected", "x", float("inf")).headers["Retry-After"] == "1"


def test_prometheus_text_of_counters_and_histograms() -> None:
    counter = Counter("c_total", "a count", ("code",))
    counter.inc(code="200")
    counter.inc(2, code='4"0')
    histogram = Histogram("h_seconds", "a time", (0.1, 1.0))
    for value in (0.05, 0.5, 5.0):
        histogram.observe(value)
    assert counter.render() == [
        "# HELP c_total a count", "# TYPE c_total counter", 'c_total{code="200"} 1', 'c_total{code="4\\"0"} 2',
    ]
    assert histogram.render()[2:] == [
        'h_seconds_bucket{le="0.1"} 1', 'h_seconds_bucket{le="1"} 2', 'h_seconds_bucket{le="+Inf"} 3',
        "h_seconds_sum 5.55", "h_seconds_count 3",
    ]
    with pytest.raises(ValueError):
        counter.inc(code="200", extra="x")
