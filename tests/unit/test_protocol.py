"""Every message type survives encode/decode; bad bytes, unknown kinds and newer versions are refused."""

from __future__ import annotations

import dataclasses
import typing

import msgpack
import pytest

from shared.engine.sampling import SamplingParams
from shared.protocol import (
    Message,
    ProtocolError,
    Sampling,
    Subjects,
    SubmitRequest,
    decode,
    encode,
    is_valid_request_id,
    message_types,
)

_SAMPLE_VALUES = {int: 7, float: 0.5, str: "x-1", bool: True, bytes: b"\x00\xffkv"}


def _example(cls: type[Message]) -> Message:
    """An instance with a non-default value in every field (nested messages built recursively)."""
    kwargs = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint = hints[f.name]
        origin = getattr(hint, "__origin__", None)
        if isinstance(hint, type) and issubclass(hint, Message):
            kwargs[f.name] = _example(hint)
        elif origin is list:
            (item,) = hint.__args__
            if getattr(item, "__origin__", None) is list:  # list[list[float]]
                kwargs[f.name] = [[1.0, 2.5], [3.0]]
            else:
                kwargs[f.name] = [_SAMPLE_VALUES[item], _SAMPLE_VALUES[item]] if item is not int else [1, 2**64 - 1]
        elif hint in _SAMPLE_VALUES:
            kwargs[f.name] = _SAMPLE_VALUES[hint]
        else:  # optional scalars: int | None, str | None, float | None
            args = [a for a in hint.__args__ if a is not type(None)]
            kwargs[f.name] = _SAMPLE_VALUES[args[0]]
    return cls(**kwargs)


@pytest.mark.parametrize("cls", message_types(), ids=lambda c: c.KIND)
def test_every_message_round_trips(cls: type[Message]) -> None:
    msg = _example(cls)
    assert decode(encode(msg)) == msg
    assert decode(encode(msg), expected=cls) == msg


def test_the_registry_holds_the_messages_services_need() -> None:
    kinds = {c.KIND for c in message_types()}
    assert {"submit", "prefill-task", "decode-task", "kv-chunk", "stream-event", "heartbeat", "kv-event",
            "cancel", "block-put", "block-get", "block-part", "block-has"} <= kinds


def test_sampling_converts_both_ways_and_validates() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, stop=("\n",), seed=3)
    assert Sampling.from_params(params).to_params() == params
    with pytest.raises(ValueError):
        Sampling(max_tokens=0).to_params()


def test_bad_bytes_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="not a tsukimi message"):
        decode(b"\xc1garbage")
    with pytest.raises(ProtocolError, match="unknown message kind"):
        decode(msgpack.packb(["no-such-kind", 1, {}]))
    with pytest.raises(ProtocolError, match="newer"):
        decode(msgpack.packb(["cancel", 99, {"request_id": "r"}]))
    with pytest.raises(ProtocolError, match="unknown field"):
        decode(msgpack.packb(["cancel", 1, {"request_id": "r", "bogus": 1}]))
    with pytest.raises(ProtocolError, match="expected submit"):
        decode(encode(_example(Sampling)), expected=SubmitRequest)


def test_subjects_share_one_prefix() -> None:
    subjects = Subjects("acme")
    names = [subjects.submit, subjects.heartbeat, subjects.cancel, subjects.kv_events("p1"), subjects.prefill_run("p1"),
             subjects.decode_run("d1"), subjects.decode_kv("d1"), subjects.stream("r1"), subjects.cache_put(0),
             subjects.cache_get(0), subjects.cache_has(0)]
    assert all(n.startswith("acme.") for n in names)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(("request_id", "ok"), [("chatcmpl-abc_1", True), ("", False), ("a.b", False),
                                                  ("a b", False), ("x" * 129, False), ("é", False)])
def test_request_ids_are_subject_tokens(request_id: str, ok: bool) -> None:
    assert is_valid_request_id(request_id) is ok
