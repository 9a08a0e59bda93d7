"""Every message type survives encode/decode; bad bytes, unknown kinds, newer versions and fields of the wrong type
are refused."""

from __future__ import annotations

import dataclasses
import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.wire.protocol import (
    BlockPut,
    Cancel,
    HandoffEnd,
    HandoffStart,
    Heartbeat,
    KvChunk,
    KvEvent,
    Message,
    PrefillTask,
    ProtocolError,
    SamplingError,
    SamplingParams,
    Subjects,
    SubmitRequest,
    decode,
    encode,
    is_valid_request_id,
    message_types,
)

_SAMPLE_VALUES = {int: 7, float: 0.5, str: "x-1", bool: True, bytes: b"\x00\xffkv"}
# Fields whose sample must also satisfy the messages' invariants (parts within totals, known kinds and roles, ...).
_VALID_VALUES = {"seq": 1, "layer_end": 9, "token_end": 9, "kind": "stored", "role": "decode",
                 "samples": [[1.0, 2.5, 3.0]], "prefill_samples": [[512.0, 4.0, 0.25]], "num_cached_tokens": 1,
                 "index": 3, "tag": b"0123456789abcdef", "start": 1, "pipeline_group": ["x-1", "x-2"]}


def _example(cls: type[Message]) -> Message:
    """An instance with a non-default value in every field (nested messages built recursively)."""
    kwargs = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint = hints[f.name]
        origin = getattr(hint, "__origin__", None)
        if f.name in _VALID_VALUES:
            kwargs[f.name] = _VALID_VALUES[f.name]
        elif isinstance(hint, type) and issubclass(hint, Message):
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
    assert {"submit", "prefill-task", "handoff-start", "handoff-end", "kv-chunk", "stream-event", "heartbeat",
            "kv-event", "cancel", "block-put", "block-get", "block-part", "block-has"} <= kinds


def test_sampling_travels_as_it_is_and_names_a_bad_field() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"], seed=3)
    assert decode(encode(params)) == params
    with pytest.raises(SamplingError) as excinfo:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert excinfo.value.field == "min_tokens"
    with pytest.raises(SamplingError) as excinfo:
        SamplingParams(output_offset=-1)
    assert excinfo.value.field == "output_offset"
    bad = msgpack.packb(["sampling", 1, {"max_tokens": 0}])
    with pytest.raises(ProtocolError, match="sampling: max_tokens must be at least 1"):
        decode(bad)


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
        decode(encode(_example(SamplingParams)), expected=SubmitRequest)


def test_subjects_share_one_prefix() -> None:
    subjects = Subjects("acme")
    names = [subjects.submit, subjects.heartbeat("prefill", "p1"), subjects.cancel, subjects.kv_events("prefill", "p1"),
             subjects.snapshot("prefill", "p1"), subjects.prefill_run("p1"),
             subjects.decode_run("d1"), subjects.decode_handoff("d1"), subjects.stream("r1"), subjects.cache_put(0),
             subjects.cache_get(0), subjects.cache_has(0)]
    assert all(n.startswith("acme.") for n in names)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(("request_id", "ok"), [("chatcmpl-abc_1", True), ("", False), ("a.b", False),
                                                  ("a b", False), ("x" * 160, True), ("x" * 161, False), ("é", False)])
def test_request_ids_are_subject_tokens(request_id: str, ok: bool) -> None:
    assert is_valid_request_id(request_id) is ok


@pytest.mark.parametrize(("fields", "complaint"), [
    ({"request_id": 7}, "'request_id' must be str"),
    ({"request_id": "r", "reason": ["x"]}, "'reason' must be str"),
    ({"request_id": None}, "'request_id' must be str"),
])
def test_a_field_of_the_wrong_type_is_a_protocol_error(fields: dict[str, object], complaint: str) -> None:
    with pytest.raises(ProtocolError, match=complaint):
        decode(msgpack.packb(["cancel", 1, fields]))


def test_lists_ints_and_floats_are_checked_to_their_elements() -> None:
    submit = _example(SubmitRequest)
    fields = msgpack.unpackb(encode(submit), raw=False)[2]
    for name, bad in [("prompt_ids", [1, "2"]), ("prompt_ids", [1, True]), ("prompt_ids", "12"),
                      ("block_hashes", [1.5]), ("arrival_time", "now"), ("ttft_slo_s", [1.0]),
                      ("sampling", {"max_tokens": "many"})]:
        with pytest.raises(ProtocolError, match=name if name != "sampling" else "max_tokens"):
            decode(msgpack.packb(["submit", 1, fields | {name: bad}]))
    as_ints = decode(msgpack.packb(["submit", 1, fields | {"arrival_time": 5, "ttft_slo_s": None}]))
    assert as_ints.arrival_time == 5.0 and isinstance(as_ints.arrival_time, float) and as_ints.ttft_slo_s is None


def test_a_missing_field_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="request_id"):
        decode(msgpack.packb(["cancel", 1, {"reason": "x"}]))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(message_types()), st.data())
def test_mutated_messages_decode_or_are_refused_never_crash(cls: type[Message], data: st.DataObject) -> None:
    """Random bytes flipped, truncated or appended in a real message: decode gives a message of a known kind or a
    ProtocolError, nothing else."""
    raw = bytearray(encode(_example(cls)))
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "cut", "grow"]))
        if action == "flip" and raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        elif action == "cut" and raw:
            del raw[data.draw(st.integers(0, len(raw) - 1)):]
        else:
            raw += data.draw(st.binary(max_size=8))
    try:
        msg = decode(bytes(raw))
    except ProtocolError:
        return
    assert isinstance(msg, Message) and type(msg) in message_types()


def test_sender_of_reads_role_and_instance_from_self_describing_subjects() -> None:
    subjects = Subjects("t")
    assert subjects.sender_of(subjects.heartbeat("decode", "decode-0")) == ("decode", "decode-0")
    assert subjects.sender_of(subjects.kv_events("cache-store", "c-1")) == ("cache-store", "c-1")
    assert subjects.sender_of(subjects.snapshot("prefill", "p")) == ("prefill", "p")
    for other in (subjects.submit, subjects.stream("r"), "t.sched.heartbeat.decode", "t.kv.events.a.b.c"):
        assert subjects.sender_of(other) is None


@pytest.mark.parametrize(("cls", "changes", "complaint"), [
    (Cancel, {"request_id": "a.b"}, "not a subject token"),
    (Cancel, {"request_id": ""}, "not a subject token"),
    (KvChunk, {"seq": 9, "total": 9}, "part 9 of 9"),
    (KvChunk, {"raw_size": -1}, "raw_size is negative"),
    (BlockPut, {"block_hash": -5}, "outside 0..2\\*\\*64-1"),
    (Heartbeat, {"samples": [[1.0, float("nan"), 2.0]]}, "step sample"),
    (Heartbeat, {"prefill_samples": [[512.0, -1.0, 0.2]]}, "step sample"),
    (Heartbeat, {"role": "admin"}, "unknown role"),
    (Heartbeat, {"num_running": -3}, "num_running is negative"),
    (Heartbeat, {"queued_attention_work": -1.0}, "queued_attention_work is negative"),
    (Heartbeat, {"queued_attention_work": float("nan")}, "queued_attention_work is not a finite number"),
    (HandoffStart, {"num_kv_chunks": 0}, "0 KV chunks"),
    (HandoffEnd, {"first_token": -1}, "a negative token id"),
    (SubmitRequest, {"prompt_ids": []}, "no token ids"),
    (SubmitRequest, {"arrival_time": float("inf")}, "arrival_time is not a finite number"),
    (KvEvent, {"kind": "purged"}, "unknown kind"),
    (PrefillTask, {"decode_id": "decode.0"}, "decode_id"),
])
def test_values_no_sender_makes_are_refused(cls: type[Message], changes: dict[str, object], complaint: str) -> None:
    fields = msgpack.unpackb(encode(_example(cls)), raw=False)[2] | changes
    with pytest.raises(ProtocolError, match=complaint):
        decode(msgpack.packb([cls.KIND, cls.VERSION, fields]))


@pytest.mark.parametrize("envelope", [[["submit"], 1, {}], [{"k": 1}, 1, {}], ["cancel", "1", {"request_id": "r"}],
                                      ["cancel", [1], {"request_id": "r"}], [None, None, None], [1, 2, 3]])
def test_an_envelope_of_the_wrong_shape_is_a_protocol_error(envelope: list[object]) -> None:
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(envelope))
