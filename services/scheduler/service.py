"""The scheduler service: the global view of instances (heartbeats, their step timings) and caches (KV events,
snapshots), and for each submitted request a placement by the configured policy and admission against the SLOs.

Placement logic is `policies.py`, predictions `estimates.py`, admission `admission.py`; this module wires them to NATS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.common.tasks import BackgroundTasks
from services.scheduler.admission import Slos, admit
from services.scheduler.cost_model import DecodeCostModel, PrefillCostModel
from services.scheduler.estimates import ClusterView, Tracked
from services.scheduler.index import BlockIndex
from services.scheduler.policies import Placement, Policy, make_policy
from shared.config import SchedulerSettings
from shared.sim.cost import prior_samples
from shared.sim.profiles import get_profile
from shared.wire.bus import Bus, BusError
from shared.wire.heartbeat import HeartbeatSender, LiveInstances, Load
from shared.wire.log import get_logger
from shared.wire.protocol import (
    SCHEDULER_QUEUE,
    Cancel,
    ErrorType,
    ExpectHandoff,
    Heartbeat,
    KvEvent,
    PrefillTask,
    Role,
    Snapshot,
    SnapshotRequest,
    StreamEvent,
    SubmitReply,
    SubmitRequest,
)

log = get_logger(__name__)
TRACK_GRACE_S = 5.0  # a tracked request absent from every heartbeat this long after placement has finished


class SchedulerService:
    """Answers `sched.submit` with a placement or a rejection; tracks instances, their speed, and every cache.

    Args:
        settings: service settings (policy, SLOs, rejection mode, instance timeout, block size).
        bus: the NATS connection.
        clock: monotonic seconds for instance liveness (tests pass their own).
        policy: overrides the configured policy (tests).
    """

    def __init__(self, settings: SchedulerSettings, bus: Bus, clock: Callable[[], float] = time.monotonic,
                 policy: Policy | None = None) -> None:
        self.settings, self.bus = settings, bus
        self.instances = LiveInstances(settings.instance_timeout_s, clock)
        self.index = BlockIndex()
        self.prefill_cost, self.decode_cost = PrefillCostModel(), DecodeCostModel()
        if settings.engine_kind == "sim":
            self._assume_profile(settings.sim_profile)
        self.is_colocated = settings.deployment == "colocated"
        self.policy = policy or make_policy(settings.policy, settings.local_prefill_tokens, settings.slo_tbt_s,
                                            self.is_colocated, settings.policy_seed)
        self.slos = Slos(settings.slo_ttft_s, settings.slo_tbt_s, settings.rejection)
        self.tracked: dict[str, Tracked] = {}
        self.num_rejected: dict[str, int] = {}
        self.tasks = BackgroundTasks()  # snapshot resyncs
        self._monitor: asyncio.Task[None] | None = None
        # Beats too, so that the gateway's /health can tell a live scheduler from none.
        self._heartbeat = HeartbeatSender(bus, settings.instance_id, Role.SCHEDULER, settings.heartbeat_s,
                                          lambda: Load(num_running=len(self.tracked)))
        # A scheduler that has just started knows no instance until each has beaten once: it waits that long for
        # them before failing a request for want of one (at start, and after a restart of the scheduler alone).
        self._ready_at = time.monotonic() + 2 * settings.heartbeat_s

    def _assume_profile(self, profile_name: str) -> None:
        """A sim system's step times are known in advance: start the cost models from them (real samples, as they
        arrive, replace these in the fit's window)."""
        prefill, decode = prior_samples(get_profile(profile_name))
        for sample in prefill:
            self.prefill_cost.add_step(*sample)
        for sample in decode:
            self.decode_cost.add_step(*sample)

    async def start(self) -> None:
        s = self.bus.subjects
        await self.bus.route(s.submit, {SubmitRequest: self.handle_submit}, queue=SCHEDULER_QUEUE)
        await self.bus.route(s.heartbeat_all, {Heartbeat: self.handle_heartbeat}, bind_sender=True)
        await self.bus.route(s.kv_events_all, {KvEvent: self.handle_kv_event}, bind_sender=True)
        await self.bus.route(s.cancel, {Cancel: self.handle_cancel})
        self._monitor = asyncio.create_task(self._watch_instances())
        self._heartbeat.start()
        log.info("scheduling", policy=self.policy.name, rejection=self.slos.mode,
                 slo_ttft_s=self.slos.ttft_s, slo_tbt_s=self.slos.tbt_s)

    async def stop(self) -> None:
        await self._heartbeat.stop()
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        await self.tasks.close()

    def view(self) -> ClusterView:
        return ClusterView(
            self.instances.alive(Role.PREFILL), self.instances.alive(Role.DECODE),
            [b.instance_id for b in self.instances.alive(Role.CACHE_STORE)], self.index, self.prefill_cost,
            self.decode_cost, self.tracked, self.settings.engine.block_size, self.settings.cache_balance_ratio,
            max_batched_tokens=self.settings.engine.max_num_batched_tokens,
        )

    async def handle_submit(self, msg: SubmitRequest) -> SubmitReply:
        view = self.view()
        while not self._has_required(view) and time.monotonic() < self._ready_at:
            await asyncio.sleep(0.05)
            view = self.view()
        view = view.for_prompt(len(msg.prompt_ids))
        required = [(Role.DECODE, view.decodes)] if self.is_colocated else [(Role.PREFILL, view.prefills),
                                                                             (Role.DECODE, view.decodes)]
        for role, alive in required:
            if not alive:
                return self._reject(msg, ErrorType.UNAVAILABLE, f"no_{role}", f"no {role} instance is alive", 1.0)
        placement = self.policy.place(msg, view)
        verdict = admit(msg, placement, view, self.slos)
        if not verdict.accepted:
            return self._reject(msg, ErrorType.REJECTED, verdict.reason_code, verdict.reason, verdict.retry_after_s)
        await self._dispatch(msg, placement)
        return SubmitReply(msg.request_id, True, placement.prefill.instance_id, placement.decode_id)

    def _has_required(self, view: ClusterView) -> bool:
        return bool(view.decodes) and (self.is_colocated or bool(view.prefills))

    def _reject(self, msg: SubmitRequest, error_type: ErrorType, code: str, reason: str, retry_s: float) -> SubmitReply:
        self.num_rejected[code] = self.num_rejected.get(code, 0) + 1
        log.warning("rejected", request_id=msg.request_id, reason_code=code, reason=reason)
        return SubmitReply(msg.request_id, False, error_type=error_type, reason=reason, retry_after_s=retry_s,
                           reason_code=code)

    async def _dispatch(self, msg: SubmitRequest, placement: Placement) -> None:
        option = placement.prefill
        task = PrefillTask(msg.request_id, msg.prompt_ids, msg.block_hashes, msg.sampling, placement.decode_id,
                           msg.arrival_time, option.fetch_from_pool)
        subjects = self.bus.subjects
        subject = subjects.decode_run(placement.decode_id) if placement.on_decode else subjects.prefill_run(
            option.instance_id)
        now = time.time()
        decode_start = now + option.ttft_s
        self.tracked[msg.request_id] = Tracked(
            msg.request_id, option.instance_id, placement.decode_id, len(msg.prompt_ids), option.compute_s, now,
            decode_start, decode_start + msg.sampling.max_tokens * placement.tbt_s,
            len(msg.prompt_ids) - option.num_reused_blocks * self.settings.engine.block_size, option.num_stages,
        )
        if not placement.on_decode:  # decode may then buffer this request's KV beyond its share for strangers
            expect = ExpectHandoff(msg.request_id, option.instance_id, len(msg.prompt_ids))
            await self.bus.publish(subjects.decode_run(placement.decode_id), expect)
        await self.bus.publish(subject, task)
        log.info("placed", request_id=msg.request_id, policy=self.policy.name, prefill=option.instance_id,
                 decode=placement.decode_id, on_decode=placement.on_decode, prompt_tokens=len(msg.prompt_ids),
                 reused_blocks=option.num_reused_blocks, fetch_from_pool=option.fetch_from_pool,
                 pipeline_stages=option.num_stages,
                 predicted_ttft_s=round(option.ttft_s, 4), predicted_tbt_s=round(placement.tbt_s, 4))

    async def handle_heartbeat(self, msg: Heartbeat) -> None:
        if msg.role not in (Role.PREFILL, Role.DECODE, Role.CACHE_STORE):
            return  # schedulers and gateways hold no work or cache to place by
        previous = self.instances.instances.get(msg.instance_id)
        if self.instances.record(msg):
            log.info("instance joined", instance_id=msg.instance_id, role=msg.role, epoch=msg.epoch)
            if previous is not None:  # restarted before its silence was noticed: what the old process held is lost
                await self._fail_instance(previous.last, forget_cache=False)
            holds_blocks = msg.role in (Role.PREFILL, Role.CACHE_STORE)  # (a restarted scheduler learns them now)
            if holds_blocks and self.index.needs_snapshot(msg.instance_id, msg.epoch):
                self.tasks.spawn(self._resync(msg.role, msg.instance_id), f"resync-{msg.instance_id}")
        if msg.role not in (Role.PREFILL, Role.DECODE):
            return
        # Samples are three numbers each (the heartbeat's invariants); a decode instance's prefill_samples are its
        # prompts computed where they are decoded.
        cost = self.prefill_cost if msg.role == Role.PREFILL else self.decode_cost
        prompts = msg.prefill_samples if msg.role == Role.DECODE else []
        for model, samples in ((cost, msg.samples), (self.prefill_cost, prompts)):
            for sample in samples:
                model.add_step(*sample)
        self._prune_tracked()

    def _prune_tracked(self) -> None:
        """Drop tracked requests that no instance holds any more (finished, failed or cancelled)."""
        held = {r for beat in self.instances.alive() for r in beat.request_ids}
        cutoff = time.time() - TRACK_GRACE_S
        for request_id, tracked in list(self.tracked.items()):
            if request_id not in held and tracked.placed_at < cutoff:
                del self.tracked[request_id]

    async def handle_kv_event(self, msg: KvEvent) -> None:
        if self.index.apply(msg):
            self.tasks.spawn(self._resync(msg.role, msg.instance_id), f"resync-{msg.instance_id}")

    async def _resync(self, role: str, instance_id: str) -> None:
        try:
            snapshot = await self.bus.request(
                self.bus.subjects.snapshot(role, instance_id), SnapshotRequest(instance_id), Snapshot, timeout_s=5.0)
            if snapshot.instance_id != instance_id:
                raise BusError(f"the snapshot of {snapshot.instance_id!r} answered for {instance_id!r}")
        except BusError as exc:
            log.warning("resync failed; forgetting the instance's blocks", instance_id=instance_id, error=str(exc))
            self.index.resync_failed(instance_id)
            return
        self.index.load_snapshot(snapshot)
        log.info("resynced", instance_id=instance_id, epoch=snapshot.epoch, blocks=len(snapshot.block_hashes))

    async def handle_cancel(self, msg: Cancel) -> None:
        self.tracked.pop(msg.request_id, None)

    async def _watch_instances(self) -> None:
        while True:
            await asyncio.sleep(self.settings.instance_timeout_s / 5)
            for beat in self.instances.forget_silent():
                await self._fail_instance(beat)

    def _tracked_on(self, beat: Heartbeat) -> set[str]:
        """Tracked requests the lost instance may hold that its last heartbeat could not show yet. Everything bound
        for a lost decode instance is lost (a KV hand-off to it would go nowhere); of a lost prefill instance's, those
        that no live decode instance has taken over."""
        if beat.role == Role.DECODE:
            return {t.request_id for t in self.tracked.values() if t.decode_id == beat.instance_id}
        decoding = {r for b in self.instances.alive(Role.DECODE) for r in b.request_ids}
        return {t.request_id for t in self.tracked.values()
                if t.prefill_id == beat.instance_id and t.request_id not in decoding}

    async def _fail_instance(self, beat: Heartbeat, forget_cache: bool = True) -> None:
        """An instance stopped beating (or restarted): fail every request it may hold (failing a finished one is
        harmless: nobody listens any more)."""
        held = set(beat.request_ids) | self._tracked_on(beat)
        if forget_cache:
            self.index.forget(beat.instance_id)
        log.warning("instance lost", instance_id=beat.instance_id, role=beat.role, failed_requests=len(held))
        for request_id in sorted(held):
            self.tracked.pop(request_id, None)
            event = StreamEvent.failure(
                request_id, ErrorType.UNAVAILABLE, f"{beat.role} instance {beat.instance_id} stopped responding"
            )
            await self.bus.publish(self.bus.subjects.failed, event)
            # Whatever survives of it elsewhere (a prefill still computing it) stops too.
            await self.bus.publish(self.bus.subjects.cancel, Cancel(request_id, event.error))
