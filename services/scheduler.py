"""The scheduler service: the global view of instances (heartbeats) and caches (KV events), and placement.

This version places each request on the least-loaded live prefill and decode instances and fails the requests of an
instance that stops beating; the cache-aware Conductor (TTFT prediction, early rejection) replaces `place` next.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.bus import Bus, run_service
from shared.config import Settings
from shared.heartbeat import LiveInstances
from shared.log import get_logger
from shared.protocol import (
    SCHEDULER_QUEUE,
    Cancel,
    ErrorType,
    Heartbeat,
    KvEvent,
    Message,
    PrefillTask,
    Role,
    StreamEvent,
    SubmitReply,
    SubmitRequest,
)

log = get_logger(__name__)


@dataclass
class _Placement:
    request_id: str
    prefill_id: str
    decode_id: str
    num_tokens: int
    placed_at: float  # unix seconds


@dataclass
class BlockIndex:
    """Which instance holds which block, from `KvEvent`s; an event gap or a new epoch marks the source stale."""

    holders: dict[int, set[str]] = field(default_factory=dict)
    last_seq: dict[str, tuple[int, int]] = field(default_factory=dict)  # instance -> (epoch, seq)
    stale: set[str] = field(default_factory=set)

    def apply(self, event: KvEvent) -> None:
        previous = self.last_seq.get(event.instance_id)
        if previous is not None and (previous[0] != event.epoch or event.seq != previous[1] + 1):
            self.stale.add(event.instance_id)  # the Conductor resyncs from a snapshot; until then, distrust
        self.last_seq[event.instance_id] = (event.epoch, event.seq)
        if event.kind == "cleared":
            self.forget(event.instance_id)
        for block_hash in event.block_hashes:
            holders = self.holders.setdefault(block_hash, set())
            if event.kind == "stored":
                holders.add(event.instance_id)
            elif event.kind == "removed":
                holders.discard(event.instance_id)

    def forget(self, instance_id: str) -> None:
        for holders in self.holders.values():
            holders.discard(instance_id)

    def num_blocks(self, instance_id: str) -> int:
        return sum(instance_id in h for h in self.holders.values())


class SchedulerService:
    """Answers `sched.submit` with a placement, tracks instances and caches, fails work of dead instances.

    Args:
        settings: service settings (instance timeout, subject prefix).
        bus: the NATS connection.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, settings: Settings, bus: Bus, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.bus = settings, bus
        self.instances = LiveInstances(settings.instance_timeout_s, clock)
        self.blocks = BlockIndex()
        self._recent: dict[str, list[_Placement]] = {}  # per instance: placements its heartbeats may not show yet
        self._last_chosen: dict[str, int] = {}
        self._num_placed = 0
        self._monitor: asyncio.Task[None] | None = None

    async def start(self) -> None:
        s = self.bus.subjects
        await self.bus.serve(s.submit, self.handle_submit, queue=SCHEDULER_QUEUE)
        await self.bus.serve(s.heartbeat, self.handle_heartbeat)
        await self.bus.serve(s.kv_events_all, self.handle_kv_event)
        await self.bus.serve(s.cancel, self.handle_cancel)
        self._monitor = asyncio.create_task(self._watch_instances())

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)

    async def handle_submit(self, msg: Message) -> SubmitReply:
        assert isinstance(msg, SubmitRequest)
        placement = self.place(msg)
        if isinstance(placement, SubmitReply):
            log.warning("not placed", request_id=msg.request_id, reason=placement.reason)
            return placement
        task = PrefillTask(
            msg.request_id, msg.prompt_ids, msg.block_hashes, msg.sampling, placement.decode_id, msg.arrival_time
        )
        await self.bus.publish(self.bus.subjects.prefill_run(placement.prefill_id), task)
        log.info("placed", request_id=msg.request_id, prefill=placement.prefill_id, decode=placement.decode_id,
                 prompt_tokens=len(msg.prompt_ids))
        return SubmitReply(msg.request_id, True, placement.prefill_id, placement.decode_id)

    def place(self, request: SubmitRequest) -> _Placement | SubmitReply:
        """Least load wins: queued prompt tokens for prefill, sequences for decode, counting at once what was
        placed since the instance's last heartbeat (so a burst does not pile onto one instance)."""
        prefills = self.instances.alive(Role.PREFILL)
        decodes = self.instances.alive(Role.DECODE)
        for role, alive in ((Role.PREFILL, prefills), (Role.DECODE, decodes)):
            if not alive:
                return SubmitReply(
                    request.request_id, False, error_type=ErrorType.UNAVAILABLE,
                    reason=f"no {role} instance is alive", retry_after_s=1.0,
                )
        prefill = min(prefills, key=lambda b: (self._prefill_load(b), self._last_chosen.get(b.instance_id, -1)))
        decode = min(decodes, key=lambda b: (self._decode_load(b), self._last_chosen.get(b.instance_id, -1)))
        placement = _Placement(
            request.request_id, prefill.instance_id, decode.instance_id, len(request.prompt_ids), time.time()
        )
        self._num_placed += 1
        for instance in (prefill.instance_id, decode.instance_id):
            self._recent.setdefault(instance, []).append(placement)
            self._last_chosen[instance] = self._num_placed
        return placement

    def _prefill_load(self, beat: Heartbeat) -> int:
        return beat.num_queued_tokens + sum(p.num_tokens for p in self._recent.get(beat.instance_id, []))

    def _decode_load(self, beat: Heartbeat) -> int:
        return beat.num_running + beat.num_waiting + len(self._recent.get(beat.instance_id, []))

    async def handle_heartbeat(self, msg: Message) -> None:
        assert isinstance(msg, Heartbeat)
        if self.instances.record(msg):
            log.info("instance joined", instance_id=msg.instance_id, role=msg.role, epoch=msg.epoch)
            self.blocks.forget(msg.instance_id)  # a new epoch starts with empty caches
        # Placements made before this beat was sent are inside its figures now.
        recent = self._recent.get(msg.instance_id)
        if recent:
            self._recent[msg.instance_id] = [p for p in recent if p.placed_at > msg.sent_at]

    async def handle_kv_event(self, msg: Message) -> None:
        assert isinstance(msg, KvEvent)
        self.blocks.apply(msg)

    async def handle_cancel(self, msg: Message) -> None:
        assert isinstance(msg, Cancel)
        for placements in self._recent.values():
            placements[:] = [p for p in placements if p.request_id != msg.request_id]

    async def _watch_instances(self) -> None:
        while True:
            await asyncio.sleep(self.settings.instance_timeout_s / 5)
            for beat in self.instances.forget_silent():
                await self._fail_instance(beat)

    async def _fail_instance(self, beat: Heartbeat) -> None:
        """An instance stopped beating: fail every request it may hold (failing a finished one is harmless:
        nobody listens any more)."""
        held = set(beat.request_ids) | {p.request_id for p in self._recent.pop(beat.instance_id, [])}
        self.blocks.forget(beat.instance_id)
        log.warning("instance lost", instance_id=beat.instance_id, role=beat.role, failed_requests=len(held))
        for request_id in sorted(held):
            event = StreamEvent(
                request_id, index=-1, token_ids=[], text="", error_type=ErrorType.UNAVAILABLE,
                error=f"{beat.role} instance {beat.instance_id} stopped responding",
            )
            await self.bus.publish(self.bus.subjects.stream(request_id), event)


async def build(settings: Settings, bus: Bus) -> SchedulerService:
    return SchedulerService(settings, bus)


def main() -> None:
    run_service(Role.SCHEDULER, build)


if __name__ == "__main__":
    main()
