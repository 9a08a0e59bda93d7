"""The scheduler's handlers without NATS: least-load placement, counting placements at once, no live instance,
and an instance that stops beating is forgotten and its requests failed."""

from __future__ import annotations

import time

import pytest
from fakes import RecordingBus

from services.scheduler import BlockIndex, SchedulerService
from shared.config import load_settings
from shared.protocol import (
    ErrorType,
    Heartbeat,
    KvEvent,
    PrefillTask,
    Role,
    Sampling,
    StreamEvent,
    SubmitReply,
    SubmitRequest,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup() -> tuple[SchedulerService, RecordingBus, Clock]:
    bus, clock = RecordingBus(), Clock()
    settings = load_settings("scheduler", {"TSUKIMI_INSTANCE_TIMEOUT_S": "3"})
    return SchedulerService(settings, bus, clock), bus, clock  # type: ignore[arg-type]


def _beat(instance: str, role: Role, queued: int = 0, running: int = 0, ids: list[str] | None = None) -> Heartbeat:
    return Heartbeat(instance, role, epoch=1, sent_at=time.time(), num_running=running, num_queued_tokens=queued,
                     request_ids=ids or [])


def _submit(request_id: str, num_tokens: int = 100) -> SubmitRequest:
    return SubmitRequest(request_id, list(range(num_tokens)), [], Sampling(), time.time())


async def test_no_live_instance_is_unavailable(setup) -> None:
    scheduler, bus, _ = setup
    reply = await scheduler.handle_submit(_submit("r1"))
    assert not reply.accepted and reply.error_type == ErrorType.UNAVAILABLE and "prefill" in reply.reason
    await scheduler.handle_heartbeat(_beat("p0", Role.PREFILL))
    reply = await scheduler.handle_submit(_submit("r2"))
    assert not reply.accepted and "decode" in reply.reason
    assert bus.published == []


async def test_least_load_wins_and_placements_count_at_once(setup) -> None:
    scheduler, bus, _ = setup
    for beat in (_beat("p0", Role.PREFILL, queued=500), _beat("p1", Role.PREFILL), _beat("d0", Role.DECODE),
                 _beat("d1", Role.DECODE, running=3)):
        await scheduler.handle_heartbeat(beat)
    first = await scheduler.handle_submit(_submit("r1", 400))
    assert (first.prefill_id, first.decode_id) == ("p1", "d0")
    (task,) = bus.on(bus.subjects.prefill_run("p1"))
    assert isinstance(task, PrefillTask) and task.decode_id == "d0" and task.request_id == "r1"
    # p1 now carries 400 placed tokens and d0 one sequence before any new heartbeat says so.
    second = await scheduler.handle_submit(_submit("r2", 200))
    assert second.prefill_id == "p1"  # 400 < 500
    third = await scheduler.handle_submit(_submit("r3", 200))
    assert third.prefill_id == "p0"  # 600 > 500
    assert [r.decode_id for r in (second, third)] == ["d0", "d0"]  # d0: 1, 2 placed < d1's 3 running
    # A heartbeat sent after the placements absorbs them into the instance's own figures.
    await scheduler.handle_heartbeat(_beat("p1", Role.PREFILL, queued=0))
    assert (await scheduler.handle_submit(_submit("r4", 10))).prefill_id == "p1"


async def test_a_silent_instance_is_forgotten_and_its_requests_fail(setup) -> None:
    scheduler, bus, clock = setup
    await scheduler.handle_heartbeat(_beat("p0", Role.PREFILL))
    await scheduler.handle_heartbeat(_beat("d0", Role.DECODE, ids=["old"]))
    placed = await scheduler.handle_submit(_submit("r1"))
    assert isinstance(placed, SubmitReply) and placed.accepted
    clock.now += 2.0
    await scheduler.handle_heartbeat(_beat("p0", Role.PREFILL))
    clock.now += 1.5  # d0 silent 3.5 s > 3 s; p0 silent 1.5 s
    assert [b.instance_id for b in scheduler.instances.alive()] == ["p0"]
    for beat in scheduler.instances.forget_silent():
        await scheduler._fail_instance(beat)
    failed = {m.request_id: m for _, m in bus.published if isinstance(m, StreamEvent)}
    assert set(failed) == {"old", "r1"}
    assert all(e.error_type == ErrorType.UNAVAILABLE and "d0" in e.error for e in failed.values())
    reply = await scheduler.handle_submit(_submit("r2"))
    assert not reply.accepted and "decode" in reply.reason


def test_block_index_follows_events_and_flags_gaps() -> None:
    index = BlockIndex()
    index.apply(KvEvent("c0", 1, 0, "stored", [1, 2, 3]))
    index.apply(KvEvent("c0", 1, 1, "removed", [2]))
    assert index.num_blocks("c0") == 2 and "c0" not in index.stale
    index.apply(KvEvent("c0", 1, 3, "stored", [4]))  # seq 2 missing
    assert "c0" in index.stale
    index.apply(KvEvent("c0", 1, 4, "cleared"))
    assert index.num_blocks("c0") == 0
