"""The scheduler's handlers without NATS: placement by each policy, counting placements at once, admission against
the SLOs (current vs predicted decode load), the Conductor's cache and load trade-offs, instance loss."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from fakes import RecordingBus

from services.scheduler.service import SchedulerService
from shared.config import load_settings
from shared.wire.protocol import (
    ErrorType,
    ExpectHandoff,
    Heartbeat,
    KvEvent,
    PrefillTask,
    Role,
    SamplingParams,
    Snapshot,
    StreamEvent,
    SubmitRequest,
)

BLOCK = 64
BLOCK_BYTES = 30 * 2 * 3 * BLOCK * 64 * 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _service(**env: str) -> tuple[SchedulerService, RecordingBus, Clock]:
    bus, clock = RecordingBus(), Clock()
    settings = load_settings("scheduler", {"TSUKIMI_INSTANCE_TIMEOUT_S": "3", "TSUKIMI_POLICY": "least_loaded",
                                            "TSUKIMI_REJECTION": "off", **env})
    return SchedulerService(settings, bus, clock), bus, clock  # type: ignore[arg-type]


def _beat(instance: str, role: Role, queued: int = 0, running: int = 0, ids: list[str] | None = None,
          blocks_used: int = 0) -> Heartbeat:
    return Heartbeat(instance, role, epoch=1, sent_at=time.time(), num_running=running, num_queued_tokens=queued,
                     kv_blocks_used=blocks_used, request_ids=ids or [], block_bytes=BLOCK_BYTES)


def _submit(request_id: str, num_tokens: int = 100, max_tokens: int = 16, hashes: list[int] | None = None,
            ttft_slo_s: float | None = None) -> SubmitRequest:
    return SubmitRequest(request_id, list(range(num_tokens)), hashes or [], SamplingParams(max_tokens=max_tokens),
                         time.time(), ttft_slo_s=ttft_slo_s)


async def _cluster(service: SchedulerService, *beats: Heartbeat) -> None:
    for beat in beats:
        await service.handle_heartbeat(beat)


async def test_no_live_instance_is_unavailable() -> None:
    scheduler, bus, _ = _service()
    reply = await scheduler.handle_submit(_submit("r1"))
    assert not reply.accepted and reply.error_type == ErrorType.UNAVAILABLE and reply.reason_code == "no_prefill"
    await scheduler.handle_heartbeat(_beat("p0", Role.PREFILL))
    reply = await scheduler.handle_submit(_submit("r2"))
    assert not reply.accepted and reply.reason_code == "no_decode"
    assert bus.published == []


async def test_a_fresh_scheduler_waits_for_the_first_heartbeats_before_refusing() -> None:
    """Started together with the instances, the scheduler may get a request before their first beats: it waits up to
    two heartbeat intervals for them instead of failing the request."""
    scheduler, bus, _ = _service(TSUKIMI_HEARTBEAT_S="1")
    submit = asyncio.create_task(scheduler.handle_submit(_submit("r1")))
    await asyncio.sleep(0.2)
    assert not submit.done()
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _beat("d0", Role.DECODE))
    reply = await asyncio.wait_for(submit, 1.0)
    assert reply.accepted and (reply.prefill_id, reply.decode_id) == ("p0", "d0")
    # decode is told to expect the hand-off (its KV may then use decode's whole buffer), then prefill gets the task
    assert [subject for subject, _ in bus.published] == [bus.subjects.decode_run("d0"), bus.subjects.prefill_run("p0")]
    assert isinstance(bus.published[0][1], ExpectHandoff) and bus.published[0][1].prefill_id == "p0"


async def test_least_loaded_counts_its_placements_at_once() -> None:
    scheduler, bus, _ = _service()
    await _cluster(scheduler, _beat("p0", Role.PREFILL, queued=500), _beat("p1", Role.PREFILL),
                   _beat("d0", Role.DECODE), _beat("d1", Role.DECODE, running=3))
    first = await scheduler.handle_submit(_submit("r1", 400))
    assert (first.prefill_id, first.decode_id) == ("p1", "d0")
    (task,) = bus.on(bus.subjects.prefill_run("p1"))
    assert isinstance(task, PrefillTask) and task.decode_id == "d0" and task.request_id == "r1"
    second = await scheduler.handle_submit(_submit("r2", 200))
    assert second.prefill_id == "p1"  # 400 placed < 500 queued
    third = await scheduler.handle_submit(_submit("r3", 200))
    assert third.prefill_id == "p0"  # 600 placed > 500
    assert [r.decode_id for r in (second, third)] == ["d0", "d0"]  # 1, 2 placed < d1's 3 running
    # A heartbeat sent after the placements carries them in the instance's own figures.
    await scheduler.handle_heartbeat(_beat("p1", Role.PREFILL, queued=0))
    assert (await scheduler.handle_submit(_submit("r4", 10))).prefill_id == "p1"


async def test_a_silent_instance_is_forgotten_and_its_requests_fail() -> None:
    scheduler, bus, clock = _service()
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _beat("d0", Role.DECODE, ids=["old"]))
    assert (await scheduler.handle_submit(_submit("r1"))).accepted
    clock.now += 2.0
    await scheduler.handle_heartbeat(_beat("p0", Role.PREFILL))
    clock.now += 1.5  # d0 silent 3.5 s > 3 s; p0 silent 1.5 s
    assert [b.instance_id for b in scheduler.instances.alive()] == ["p0"]
    for beat in scheduler.instances.forget_silent():
        await scheduler._fail_instance(beat)
    failed = {m.request_id: m for _, m in bus.published if isinstance(m, StreamEvent)}
    assert set(failed) == {"old", "r1"}
    assert all(e.error_type == ErrorType.UNAVAILABLE and "d0" in e.error for e in failed.values())
    assert (await scheduler.handle_submit(_submit("r2"))).reason_code == "no_decode"


async def test_heartbeat_samples_refit_the_cost_models() -> None:
    scheduler, _, _ = _service()
    samples = [[float(n), n * n / 2.0, 0.005 + n / 1000.0] for n in range(50, 2050, 100)]
    await scheduler.handle_heartbeat(Heartbeat("p0", Role.PREFILL, 1, time.time(), samples=samples))
    assert scheduler.prefill_cost.predict(1000, 0) == pytest.approx(1.005, rel=0.05)
    decode_samples = [[float(b), 1000.0 * b, 0.02 + 0.01 * b] for b in range(1, 20)]
    await scheduler.handle_heartbeat(Heartbeat("d0", Role.DECODE, 1, time.time(), samples=decode_samples))
    assert scheduler.decode_cost.predict(10, 10_000) == pytest.approx(0.12, rel=0.05)


async def test_prompts_computed_on_decode_refit_the_prefill_model() -> None:
    """A colocated deployment has no prefill instance: its prompts are priced from the decode instances' own."""
    scheduler, _, _ = _service()
    prior = scheduler.prefill_cost.predict(1000, 0)
    samples = [[float(n), n * n / 2.0, 0.005 + n / 4000.0] for n in range(50, 2050, 100)]
    await scheduler.handle_heartbeat(Heartbeat("d0", Role.DECODE, 1, time.time(), prefill_samples=samples))
    assert scheduler.prefill_cost.predict(1000, 0) == pytest.approx(0.255, rel=0.05) != prior
    assert scheduler.decode_cost.model.num_samples == 0  # they are not decode steps


async def test_ttft_slo_rejects_before_any_work_with_retry_after() -> None:
    scheduler, bus, _ = _service(TSUKIMI_REJECTION="current", TSUKIMI_SLO_TTFT_MS="2000")
    await _cluster(scheduler, _beat("p0", Role.PREFILL, queued=3000), _beat("d0", Role.DECODE))
    reply = await scheduler.handle_submit(_submit("r1", 500))
    assert not reply.accepted and reply.error_type == ErrorType.REJECTED and reply.reason_code == "ttft_slo"
    assert reply.retry_after_s >= 1.0 and "time to first token" in reply.reason
    assert bus.published == [] and scheduler.num_rejected == {"ttft_slo": 1}
    # A request may tighten the SLO, never loosen it.
    await scheduler.handle_heartbeat(_beat("p0", Role.PREFILL, queued=0))
    assert (await scheduler.handle_submit(_submit("r2", 300))).accepted
    assert not (await scheduler.handle_submit(_submit("r3", 300, ttft_slo_s=0.05))).accepted


async def test_a_request_placed_again_is_not_judged_again() -> None:
    """Its instance was lost: its client is waiting (maybe mid-answer) on work already accepted."""
    scheduler, bus, _ = _service(TSUKIMI_REJECTION="current", TSUKIMI_SLO_TTFT_MS="2000")
    await _cluster(scheduler, _beat("p0", Role.PREFILL, queued=3000), _beat("d0", Role.DECODE))
    assert not (await scheduler.handle_submit(_submit("r1", 500))).accepted
    moved = dataclasses.replace(_submit("r1-r1", 500), num_placed_before=1)
    reply = await scheduler.handle_submit(moved)
    assert reply.accepted and reply.prefill_id == "p0" and scheduler.num_rejected == {"ttft_slo": 1}
    assert [m.request_id for _, m in bus.published if isinstance(m, PrefillTask)] == ["r1-r1"]


async def test_predicted_mode_admits_what_current_load_would_refuse() -> None:
    """Decode is full now, but its requests finish before this long prompt would reach it."""
    results = {}
    for mode in ("current", "predicted"):
        scheduler, _, _ = _service(TSUKIMI_REJECTION=mode, TSUKIMI_SLO_TBT_MS="140", TSUKIMI_SLO_TTFT_MS="60000")
        await _cluster(scheduler, _beat("p0", Role.PREFILL), _beat("d0", Role.DECODE))
        for i in range(12):  # short prompts with 21 tokens each: decoding soon, done soon
            assert (await scheduler.handle_submit(_submit(f"s{i}", 20, max_tokens=21))).accepted
        reply = await scheduler.handle_submit(_submit("long", 4000))  # ~13 s of prefill before decode
        results[mode] = reply
    assert not results["current"].accepted and results["current"].reason_code == "tbt_slo"
    assert results["predicted"].accepted


async def test_conductor_trades_cache_hits_against_queues() -> None:
    scheduler, bus, _ = _service(TSUKIMI_POLICY="conductor", TSUKIMI_LOCAL_PREFILL_TOKENS="0")
    hashes = list(range(1000, 1016))  # a 1024-token prompt's 16 blocks
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _beat("p1", Role.PREFILL), _beat("d0", Role.DECODE),
                   _beat("c0", Role.CACHE_STORE))
    await scheduler.handle_kv_event(KvEvent("p1", 1, 0, "stored", hashes[:12]))
    hit = await scheduler.handle_submit(_submit("r1", 1024, hashes=hashes))
    assert hit.prefill_id == "p1"  # its local prefix saves most of the work
    task = bus.on(bus.subjects.prefill_run("p1"))[-1]
    assert isinstance(task, PrefillTask) and not task.fetch_from_pool
    # p1 is now far busier: the cache hit no longer pays, p0 fetches the whole prefix from the pool instead.
    await scheduler.handle_kv_event(KvEvent("c0", 1, 0, "stored", hashes))
    await scheduler.handle_heartbeat(_beat("p1", Role.PREFILL, queued=6000))
    other = await scheduler.handle_submit(_submit("r2", 1024, hashes=hashes))
    assert other.prefill_id == "p0"
    task = bus.on(bus.subjects.prefill_run("p0"))[-1]
    assert isinstance(task, PrefillTask) and task.fetch_from_pool


async def test_a_restarted_scheduler_learns_the_caches_from_their_snapshots() -> None:
    """Instances that were there before it: their first heartbeat asks for their blocks, and the Conductor places by
    them at once (issue 23: a restarted scheduler takes over with the block index)."""
    scheduler, bus, _ = _service(TSUKIMI_POLICY="conductor", TSUKIMI_LOCAL_PREFILL_TOKENS="0")
    hashes = list(range(1000, 1016))  # a 1024-token prompt's 16 blocks
    bus.snapshots["p1"] = Snapshot("p1", 1, 30, hashes[:12])
    bus.snapshots["c0"] = Snapshot("c0", 1, 41, hashes)
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _beat("p1", Role.PREFILL), _beat("d0", Role.DECODE),
                   _beat("c0", Role.CACHE_STORE))
    for _ in range(3):
        await asyncio.sleep(0)  # the resyncs run
    assert sorted(m.instance_id for _, m in bus.requested) == ["c0", "p0", "p1"]  # p0 did not answer: none known
    assert scheduler.index.prefix_len("p1", hashes) == 12
    assert scheduler.index.pool_prefix_len(["c0"], hashes) == 16
    reply = await scheduler.handle_submit(_submit("r1", 1024, hashes=hashes))
    task = bus.on(bus.subjects.prefill_run(reply.prefill_id))[-1]
    assert isinstance(task, PrefillTask) and (task.fetch_from_pool or reply.prefill_id == "p1")  # reused, not redone


async def test_conductor_prefills_a_short_prompt_on_decode_when_prefill_is_busy() -> None:
    scheduler, bus, _ = _service(TSUKIMI_POLICY="conductor", TSUKIMI_LOCAL_PREFILL_TOKENS="128")
    await _cluster(scheduler, _beat("p0", Role.PREFILL, queued=3000), _beat("d0", Role.DECODE))
    reply = await scheduler.handle_submit(_submit("short", 40))
    assert reply.prefill_id == "d0"
    (task,) = bus.on(bus.subjects.decode_run("d0"))
    assert isinstance(task, PrefillTask) and task.request_id == "short"
    long_reply = await scheduler.handle_submit(_submit("long", 400))
    assert long_reply.prefill_id == "p0"  # too long to prefill on decode


@pytest.mark.parametrize("policy", ["random", "round_robin", "local_cache_aware"])
async def test_every_policy_places_on_live_instances(policy: str) -> None:
    scheduler, _, _ = _service(TSUKIMI_POLICY=policy)
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _beat("p1", Role.PREFILL), _beat("d0", Role.DECODE))
    replies = [await scheduler.handle_submit(_submit(f"r{i}")) for i in range(8)]
    assert all(r.accepted and r.prefill_id in ("p0", "p1") and r.decode_id == "d0" for r in replies)
    if policy == "round_robin":
        assert [r.prefill_id for r in replies[:4]] == ["p0", "p1", "p0", "p1"]


async def test_an_instance_restarted_before_its_silence_was_noticed_fails_its_requests() -> None:
    scheduler, bus, _ = _service()
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _beat("d0", Role.DECODE, ids=["lost"]))
    restarted = Heartbeat("d0", Role.DECODE, epoch=2, sent_at=time.time())
    await scheduler.handle_heartbeat(restarted)
    failed = [m for _, m in bus.published if isinstance(m, StreamEvent)]
    assert [e.request_id for e in failed] == ["lost"] and failed[0].error_type == ErrorType.UNAVAILABLE
    await scheduler.handle_heartbeat(restarted)  # the same epoch again: nothing more
    assert len([m for _, m in bus.published if isinstance(m, StreamEvent)]) == 1


async def test_a_lost_decode_fails_what_was_bound_for_it_even_between_heartbeats() -> None:
    """Placed before the decode's last heartbeat, but its KV had not arrived yet: the beat could not list it."""
    scheduler, bus, clock = _service()
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _beat("d0", Role.DECODE))
    assert (await scheduler.handle_submit(_submit("in-flight"))).accepted
    await scheduler.handle_heartbeat(_beat("d0", Role.DECODE))  # sent after the placement, without the request
    await scheduler.handle_heartbeat(_beat("p0", Role.PREFILL, ids=[]))  # handed off already
    clock.now += 5.0
    for beat in scheduler.instances.forget_silent():
        if beat.role == Role.DECODE:
            await scheduler._fail_instance(beat)
    failed = [m.request_id for _, m in bus.published if isinstance(m, StreamEvent)]
    cancels = [m.request_id for s, m in bus.published if s == bus.subjects.cancel]
    assert failed == ["in-flight"] and cancels == ["in-flight"]


async def test_a_task_still_on_its_way_counts_in_the_queue_of_a_beat_sent_after_its_placement() -> None:
    """A heartbeat that left just after a placement, before the task reached the instance, shows neither the request
    nor its tokens: the placement still counts in that instance's queue; once a beat lists the request, its own
    figures count it, not twice."""
    scheduler, _, _ = _service(TSUKIMI_POLICY="least_loaded")
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _beat("d0", Role.DECODE))
    assert (await scheduler.handle_submit(_submit("r1", 2000))).prefill_id == "p0"
    await scheduler.handle_heartbeat(_beat("p0", Role.PREFILL))  # sent after the placement; r1 not there yet
    view = scheduler.view()
    (beat,) = view.prefills
    assert view.queued_work(beat)[0] == 2000 and view.queue_s(beat) > 0
    await scheduler.handle_heartbeat(_beat("p0", Role.PREFILL, queued=2000, ids=["r1"]))
    view = scheduler.view()
    assert view.queued_work(view.prefills[0])[0] == 2000
