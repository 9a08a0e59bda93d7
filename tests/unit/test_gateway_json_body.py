"""The gateway's body parser: every lone surrogate refused wherever it sits, whatever the escape's case; valid text
and token ids accepted (a body without a surrogate escape skips the walk over its values)."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError
from services.gateway.json_body import parse_json_object


@pytest.mark.parametrize("body", [
    b'{"a": "\\ud800"}',
    b'{"a": ["x", {"b": "ok \\uDFFF"}]}',
    b'{"\\uDbff": 1}',
    b'{"prompt": [1, 2, 3], "stop": ["\\udc00"]}',
])
def test_a_lone_surrogate_is_refused_wherever_it_is(body: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        parse_json_object(body)
    assert caught.value.status == 400 and "surrogate" in caught.value.message


@pytest.mark.parametrize(("body", "value"), [
    (b'{"a": "\\ud83d\\ude00"}', {"a": "\U0001f600"}),  # a pair is one character
    (b'{"a": "\\\\ud800"}', {"a": "\\ud800"}),  # an escaped backslash: the text holds no surrogate
    (b'{"prompt": [0, 1, 4294967295]}', {"prompt": [0, 1, 4294967295]}),
])
def test_valid_text_and_token_ids_are_accepted(body: bytes, value: dict[str, object]) -> None:
    assert parse_json_object(body) == value
