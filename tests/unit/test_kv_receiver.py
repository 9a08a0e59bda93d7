"""A decode instance's incoming KV streams (`KvReceiver`): a stalled stream expires while another completes, a
complete one is handed over once, a failed or discarded one ignores its late chunks, and the byte budget is shared,
with a small share for streams the scheduler did not announce."""

from __future__ import annotations

import dataclasses

import torch
from kv_wire_fixtures import ONE_BLOCK, TOKENS, all_chunks, assembled, smooth_kv, tensor_bytes

from shared.wire.kv_transfer.chunks import KvTransferError
from shared.wire.kv_transfer.receiver import UNANNOUNCED_SHARE, KvReceiver


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def two_layers() -> torch.Tensor:
    return smooth_kv(2, 3, TOKENS, 64)  # 12 chunks at one block a chunk


def test_receiver_expires_a_stalled_stream_while_another_completes() -> None:
    clock = FakeClock()
    receiver = KvReceiver(deadline_s=10.0, clock=clock)
    kv = two_layers()
    stalled, healthy = all_chunks("r1", kv, ONE_BLOCK), all_chunks("r2", kv, ONE_BLOCK)
    assert len(stalled) == 12
    for chunk in stalled[:7] + healthy:
        assert receiver.add(chunk) is None
    assert "r1" in receiver and len(receiver) == 2
    assert receiver.is_complete("r2") and not receiver.is_complete("r1")
    clock.now += 9.9
    assert receiver.expire() == []
    clock.now += 0.1
    assert receiver.expire() == [
        ("r1", "KV transfer stalled: 5 of 12 chunks missing after 10.0 s"),
        ("r2", "KV transfer complete but not taken after 10.0 s"),
    ]
    assert len(receiver) == 0
    assert receiver.add(stalled[7]) is None and "r1" not in receiver  # a late chunk does not reopen it


def test_receiver_hands_over_a_complete_assembly() -> None:
    receiver = KvReceiver(deadline_s=10.0, clock=FakeClock())
    kv = two_layers()
    chunks = all_chunks("r2", kv, ONE_BLOCK)
    for chunk in chunks[:-1]:
        receiver.add(chunk)
    assert receiver.take_complete("r2") is None and "r2" in receiver
    receiver.add(chunks[-1])
    assembly = receiver.take_complete("r2")
    assert assembly is not None and "r2" not in receiver
    assert tensor_bytes(assembled(assembly, kv)) == tensor_bytes(kv)
    assert receiver.take_complete("r2") is None and receiver.take_complete("r9") is None


def test_receiver_returns_errors_and_ignores_the_failed_requests_late_chunks() -> None:
    clock = FakeClock()
    receiver = KvReceiver(deadline_s=10.0, clock=clock)
    chunks = all_chunks("r1", two_layers(), ONE_BLOCK)
    assert receiver.add(chunks[0]) is None
    error = receiver.add(dataclasses.replace(chunks[1], checksum=chunks[1].checksum ^ 1))
    assert isinstance(error, KvTransferError) and "chunk 1/12 failed its checksum" in str(error)
    assert "r1" not in receiver
    assert all(receiver.add(chunk) is None for chunk in chunks[1:])
    assert "r1" not in receiver and receiver.expire() == []
    clock.now += 10 * 10.0 + 1  # forgotten after ten deadlines
    receiver.expire()
    assert receiver.add(chunks[0]) is None and "r1" in receiver
    error = receiver.add(dataclasses.replace(chunks[0], request_id="r3", total=0))
    assert isinstance(error, KvTransferError) and "r3" not in receiver
    error = receiver.add(dataclasses.replace(chunks[0], request_id="r4", kv_format=""))
    assert isinstance(error, KvTransferError) and "names no KV format" in str(error) and "r4" not in receiver


def test_discard_drops_a_stream_and_its_late_chunks() -> None:
    clock = FakeClock()
    receiver = KvReceiver(deadline_s=10.0, clock=clock)
    chunks = all_chunks("r1", two_layers(), ONE_BLOCK)
    receiver.add(chunks[0])
    receiver.discard("r1")
    receiver.discard("never-seen")
    assert "r1" not in receiver and len(receiver) == 0
    assert receiver.add(chunks[1]) is None and "r1" not in receiver
    clock.now += 11
    assert receiver.expire() == []


def test_kv_nobody_announced_gets_a_small_share_of_the_buffer() -> None:
    kv = two_layers()
    held = kv.numel() * kv.element_size()  # what a whole stream holds, decompressed
    receiver = KvReceiver(deadline_s=10.0, max_bytes=UNANNOUNCED_SHARE * (held // 2), clock=FakeClock())
    receiver.expect("announced")
    stranger = [receiver.add(chunk) for chunk in all_chunks("stranger", kv, ONE_BLOCK)]
    error = next(e for e in stranger if e is not None)
    assert "did not place here" in str(error) and "stranger" not in receiver
    assert receiver.num_unannounced_bytes == 0  # what it held is given back
    assert all(receiver.add(chunk) is None for chunk in all_chunks("announced", kv, ONE_BLOCK))
    assert receiver.is_complete("announced") and receiver.num_held_bytes == held
    late = all_chunks("late", kv, ONE_BLOCK)  # chunks before their announcement (across a NATS cluster)
    assert receiver.add(late[0]) is None and receiver.num_unannounced_bytes == late[0].raw_size
    receiver.expect("late")
    assert receiver.num_unannounced_bytes == 0 and all(receiver.add(chunk) is None for chunk in late[1:])


def test_the_buffer_is_shared_by_every_stream_and_freed_as_they_close() -> None:
    kv = two_layers()
    held = kv.numel() * kv.element_size()
    receiver = KvReceiver(deadline_s=10.0, max_bytes=held * 3 // 2, clock=FakeClock())
    for request_id in ("a", "b", "c"):
        receiver.expect(request_id)
    assert all(receiver.add(chunk) is None for chunk in all_chunks("a", kv, ONE_BLOCK))
    errors = [receiver.add(chunk) for chunk in all_chunks("b", kv, ONE_BLOCK)]
    assert "KV buffer is full" in str(next(e for e in errors if e is not None)) and "b" not in receiver
    assert receiver.take_complete("a") is not None and receiver.num_held_bytes == 0
    assert all(receiver.add(chunk) is None for chunk in all_chunks("c", kv, ONE_BLOCK))
    receiver.discard("c")
    assert receiver.num_held_bytes == receiver.num_unannounced_bytes == 0


def test_announcements_expire_and_are_bounded() -> None:
    clock = FakeClock()
    receiver = KvReceiver(deadline_s=10.0, expect_ttl_s=60.0, clock=clock)
    receiver.expect("r1")
    clock.now += 59
    receiver.expire()
    assert receiver.is_expected("r1")
    clock.now += 2
    receiver.expire()
    assert not receiver.is_expected("r1")
