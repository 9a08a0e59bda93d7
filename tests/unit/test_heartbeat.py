"""A heartbeat carries every load figure under the same name, and `LiveInstances` forgets the silent."""

from __future__ import annotations

import dataclasses

from shared.wire.heartbeat import HeartbeatSender, LiveInstances, Load
from shared.wire.protocol import Heartbeat


def test_load_is_exactly_the_variable_part_of_a_heartbeat() -> None:
    fixed = {"instance_id", "role", "epoch", "sent_at"}
    assert {f.name for f in dataclasses.fields(Load)} == {f.name for f in dataclasses.fields(Heartbeat)} - fixed


def test_a_beat_copies_the_load() -> None:
    load = Load(num_running=2, request_ids=["a"], samples=[[1.0, 2.0, 0.5]], block_bytes=64)
    beat = HeartbeatSender(None, "d0", "decode", 1.0, lambda: load).beat()  # type: ignore[arg-type]
    assert (beat.instance_id, beat.num_running, beat.request_ids, beat.samples, beat.block_bytes) == (
        "d0", 2, ["a"], [[1.0, 2.0, 0.5]], 64)
    load.request_ids.append("b")
    assert beat.request_ids == ["a"]


def test_live_instances_forget_the_silent() -> None:
    now = [0.0]
    live = LiveInstances(3.0, clock=lambda: now[0])
    assert live.record(Heartbeat("p0", "prefill", 1, 0.0))
    assert not live.record(Heartbeat("p0", "prefill", 1, 0.0))
    assert live.record(Heartbeat("p0", "prefill", 2, 0.0))  # a new epoch: restarted
    now[0] = 3.5
    assert [b.instance_id for b in live.forget_silent()] == ["p0"] and live.alive() == []
