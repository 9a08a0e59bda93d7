"""A decode instance's incoming hand-off streams (`HandoffReceiver`): a stalled stream expires while another ends
whole and is handed over once; a stream whose parts were lost fails at its end; a failed or closed stream ignores
its late messages; parts with no start fail; and the byte budget is shared, with a small share for streams the
scheduler did not announce."""

from __future__ import annotations

import dataclasses

import torch
from kv_wire_fixtures import ONE_BLOCK, TOKENS, all_chunks, assembled, smooth_kv, tensor_bytes

from shared.wire.handoff.receiver import UNANNOUNCED_SHARE, HandoffReceiver
from shared.wire.parts import PartError
from shared.wire.protocol import HandoffEnd, HandoffStart, KvChunk, SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def two_layers() -> torch.Tensor:
    return smooth_kv(2, 3, TOKENS, 64)  # 12 chunks at one block a chunk


def start(request_id: str, num_kv_chunks: int = 12) -> HandoffStart:
    return HandoffStart(request_id, list(range(TOKENS)), SamplingParams(max_tokens=4), "p0", num_kv_chunks)


def end(request_id: str, num_profile_parts: int = 0) -> HandoffEnd:
    return HandoffEnd(request_id, 7, "seven", 0, num_profile_parts)


def opened(receiver: HandoffReceiver, request_id: str, chunks: list[KvChunk]) -> None:
    """Start the request's stream (of as many chunks as `chunks` say) and take `chunks`."""
    assert receiver.start(start(request_id, chunks[0].total if chunks else 12)) is None
    assert all(receiver.add(chunk) is None for chunk in chunks)


def test_a_stalled_stream_expires_while_another_ends_and_is_handed_over_once() -> None:
    clock = FakeClock()
    receiver = HandoffReceiver(deadline_s=10.0, clock=clock)
    kv = two_layers()
    stalled, healthy = all_chunks("r1", kv, ONE_BLOCK), all_chunks("r2", kv, ONE_BLOCK)
    assert len(stalled) == 12
    opened(receiver, "r1", stalled[:7])
    assert receiver.start(start("r1")) is None  # an identical repeat is ignored
    opened(receiver, "r2", healthy)
    assert len(receiver) == 2
    clock.now += 9.9
    assert receiver.expire() == []
    stream, error = receiver.end(end("r2"))
    assert error is None and stream is not None and "r2" not in receiver and receiver.is_closed("r2")
    assert tensor_bytes(assembled(stream.kv, kv)) == tensor_bytes(kv)
    assert receiver.end(end("r2")) == (None, None)  # taken once
    clock.now += 0.1
    assert receiver.expire() == [("r1", "hand-off stalled: 5 of 12 KV chunks missing after 10.0 s")]
    assert len(receiver) == 0 and receiver.num_held_bytes == 0
    assert receiver.add(stalled[7]) is None and "r1" not in receiver  # a late chunk does not reopen it


def test_a_stream_missing_parts_at_its_end_fails_at_once() -> None:
    receiver = HandoffReceiver(deadline_s=10.0, clock=FakeClock())
    chunks = all_chunks("r1", two_layers(), ONE_BLOCK)
    opened(receiver, "r1", chunks[:5] + chunks[6:])
    stream, error = receiver.end(end("r1"))
    assert stream is None and isinstance(error, PartError) and "1 of 12 chunks missing (5)" in str(error)
    opened(receiver, "r2", [dataclasses.replace(c, request_id="r2") for c in chunks])
    stream, error = receiver.end(end("r2", num_profile_parts=2))
    assert stream is None and "0 of 2 FastGen profile parts arrived" in str(error)
    assert len(receiver) == 0 and receiver.num_held_bytes == 0


def test_errors_are_returned_and_the_failed_streams_late_messages_ignored() -> None:
    clock = FakeClock()
    receiver = HandoffReceiver(deadline_s=10.0, clock=clock)
    chunks = all_chunks("r1", two_layers(), ONE_BLOCK)
    opened(receiver, "r1", chunks[:1])
    error = receiver.add(dataclasses.replace(chunks[1], checksum=chunks[1].checksum ^ 1))
    assert isinstance(error, PartError) and "chunk 1/12 failed its checksum" in str(error)
    assert "r1" not in receiver
    assert all(receiver.add(chunk) is None for chunk in chunks[1:]) and receiver.end(end("r1")) == (None, None)
    assert "r1" not in receiver and receiver.expire() == []
    clock.now += 10 * 10.0 + 1  # forgotten after ten deadlines
    receiver.expire()
    assert receiver.start(start("r1")) is None and "r1" in receiver
    error = receiver.start(dataclasses.replace(start("r1"), prompt_ids=[1]))
    assert "started twice, differently" in str(error) and "r1" not in receiver
    assert "a whole of 0 chunks" in str(receiver.start(start("r3", 0))) and "r3" not in receiver
    opened(receiver, "r4", [])
    error = receiver.add(dataclasses.replace(chunks[0], request_id="r4", kv_format=""))
    assert isinstance(error, PartError) and "names no KV format" in str(error) and "r4" not in receiver


def test_parts_and_ends_of_a_stream_never_started_fail() -> None:
    receiver = HandoffReceiver(deadline_s=10.0, clock=FakeClock())
    chunk = all_chunks("ghost", two_layers(), ONE_BLOCK)[0]
    assert "before its hand-off started" in str(receiver.add(chunk))
    assert receiver.add(chunk) is None  # closed now: ignored
    _, error = receiver.end(end("phantom"))
    assert "ended before it started" in str(error) and len(receiver) == 0


def test_close_drops_a_stream_and_its_late_messages() -> None:
    clock = FakeClock()
    receiver = HandoffReceiver(deadline_s=10.0, clock=clock)
    chunks = all_chunks("r1", two_layers(), ONE_BLOCK)
    opened(receiver, "r1", chunks[:1])
    receiver.close("r1")
    receiver.close("never-seen")
    assert "r1" not in receiver and len(receiver) == 0 and receiver.num_held_bytes == 0
    assert receiver.add(chunks[1]) is None and "r1" not in receiver
    clock.now += 11
    assert receiver.expire() == []


def test_kv_nobody_announced_gets_a_small_share_of_the_buffer() -> None:
    kv = two_layers()
    held = kv.numel() * kv.element_size()  # what a whole stream holds, decompressed
    receiver = HandoffReceiver(deadline_s=10.0, max_bytes=UNANNOUNCED_SHARE * (held // 2), clock=FakeClock())
    receiver.expect("announced")
    assert receiver.start(start("stranger")) is None
    stranger = [receiver.add(chunk) for chunk in all_chunks("stranger", kv, ONE_BLOCK)]
    error = next(e for e in stranger if e is not None)
    assert "did not place here" in str(error) and "stranger" not in receiver
    assert receiver.num_unannounced_bytes == 0  # what it held is given back
    opened(receiver, "announced", all_chunks("announced", kv, ONE_BLOCK))
    assert receiver.num_held_bytes == held
    late = all_chunks("late", kv, ONE_BLOCK)  # a stream before its announcement (across a NATS cluster)
    opened(receiver, "late", late[:1])
    assert receiver.num_unannounced_bytes == late[0].raw_size
    receiver.expect("late")
    assert receiver.num_unannounced_bytes == 0 and all(receiver.add(chunk) is None for chunk in late[1:])


def test_the_buffer_is_shared_by_every_stream_and_freed_as_they_close() -> None:
    kv = two_layers()
    held = kv.numel() * kv.element_size()
    receiver = HandoffReceiver(deadline_s=10.0, max_bytes=held * 3 // 2, clock=FakeClock())
    for request_id in ("a", "b", "c"):
        receiver.expect(request_id)
    opened(receiver, "a", all_chunks("a", kv, ONE_BLOCK))
    assert receiver.start(start("b")) is None
    errors = [receiver.add(chunk) for chunk in all_chunks("b", kv, ONE_BLOCK)]
    assert "KV buffer is full" in str(next(e for e in errors if e is not None)) and "b" not in receiver
    assert receiver.end(end("a"))[0] is not None and receiver.num_held_bytes == 0
    opened(receiver, "c", all_chunks("c", kv, ONE_BLOCK))
    receiver.close("c")
    assert receiver.num_held_bytes == receiver.num_unannounced_bytes == 0


def test_announcements_expire_and_are_bounded() -> None:
    clock = FakeClock()
    receiver = HandoffReceiver(deadline_s=10.0, expect_ttl_s=60.0, clock=clock)
    receiver.expect("r1")
    clock.now += 59
    receiver.expire()
    assert receiver.is_expected("r1")
    clock.now += 2
    receiver.expire()
    assert not receiver.is_expected("r1")


def test_a_stream_waiting_in_prefills_queue_is_not_a_stall_until_the_request_limit() -> None:
    """The stream opens when prefill admits the request; under load its first KV can come long after. Only once KV
    flows does the stall deadline apply; before, the request's own limit."""
    clock = FakeClock()
    receiver = HandoffReceiver(deadline_s=10.0, expect_ttl_s=60.0, clock=clock)
    kv = two_layers()
    chunks = all_chunks("queued", kv, ONE_BLOCK)
    opened(receiver, "queued", [])
    opened(receiver, "forgotten", [])
    clock.now += 30  # three stall deadlines in prefill's queue
    assert receiver.expire() == [] and "queued" in receiver
    assert receiver.add(chunks[0]) is None
    clock.now += 9
    assert receiver.expire() == []
    clock.now += 1
    assert receiver.expire() == [("queued", "hand-off stalled: 11 of 12 KV chunks missing after 10.0 s")]
    clock.now += 20  # 60 s since "forgotten" opened with no KV at all
    assert receiver.expire() == [("forgotten", "hand-off never began: no KV after 60.0 s")]
