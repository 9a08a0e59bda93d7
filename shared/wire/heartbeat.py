"""Heartbeats: every instance announces itself and its load on `sched.heartbeat`; listeners track who is alive.

`HeartbeatSender` runs in every service; `LiveInstances` is the listener's view (scheduler, gateway health).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.wire.bus import Bus
from shared.wire.log import get_logger
from shared.wire.protocol import Heartbeat

log = get_logger(__name__)


@dataclass(frozen=True)
class Load:
    """An instance's load figures at one moment: the variable part of a `Heartbeat`, under the same field names
    (a test keeps them in step)."""

    num_running: int = 0
    num_waiting: int = 0
    num_queued_tokens: int = 0
    queued_attention_work: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    request_ids: list[str] = field(default_factory=list)
    samples: list[list[float]] = field(default_factory=list)  # see Heartbeat.samples
    prefill_samples: list[list[float]] = field(default_factory=list)  # see Heartbeat.prefill_samples
    fetch_bytes_per_s: float = 0.0
    block_bytes: int = 0
    kv_format: str = ""
    kv_block_tokens: int = 0
    kv_stored_bytes: int = 0
    kv_stored_blocks: int = 0
    kv_moved_bytes: int = 0
    kv_moved_tokens: int = 0
    kv_saved_bytes: int = 0
    max_num_seqs: int = 0
    max_batched_tokens: int = 0
    pipeline_group: list[str] = field(default_factory=list)
    pipeline_min_tokens: int = 0
    pipeline_row_bytes: int = 0
    pipeline_namespace: str = ""


_LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(Load))


def _copied(value: Any) -> Any:
    """A list of the load copied two levels deep (`samples` rows are lists); anything else is immutable."""
    return [list(v) if type(v) is list else v for v in value] if type(value) is list else value


def new_epoch() -> int:
    """An epoch for this process start: listeners then know its caches and queues started empty."""
    return time.time_ns() ^ os.getpid()


class HeartbeatSender:
    """Publishes a heartbeat every `interval_s` until stopped.

    Args:
        bus: the connection.
        instance_id, role: who we are.
        interval_s: seconds between beats.
        load: called for each beat; returns the current load.
    """

    def __init__(
        self, bus: Bus, instance_id: str, role: str, interval_s: float, load: Callable[[], Load],
        epoch: int | None = None,
    ) -> None:
        self.bus, self.instance_id, self.role, self.interval_s, self.load = bus, instance_id, role, interval_s, load
        self.epoch = new_epoch() if epoch is None else epoch
        self._task: asyncio.Task[None] | None = None

    def beat(self) -> Heartbeat:
        load = self.load()  # the beat shares no list with the service: lists (of strs, of sample rows) copied
        figures = {name: _copied(getattr(load, name)) for name in _LOAD_FIELDS}
        return Heartbeat(self.instance_id, self.role, self.epoch, time.time(), **figures)

    async def send_now(self) -> None:
        await self.bus.publish(self.bus.subjects.heartbeat(self.role, self.instance_id), self.beat())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.instance_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.send_now()
            except Exception as exc:  # a NATS hiccup must not end the heartbeats
                log.warning("heartbeat failed", error=str(exc))
            await asyncio.sleep(self.interval_s)


@dataclass
class InstanceView:
    last: Heartbeat
    seen_at: float  # monotonic seconds when `last` arrived


class LiveInstances:
    """The latest heartbeat of every instance; an instance silent for `timeout_s` counts as gone.

    Args:
        timeout_s: silence after which an instance is forgotten.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.instances: dict[str, InstanceView] = {}

    def record(self, beat: Heartbeat) -> bool:
        """Store a heartbeat; True when the instance is new or restarted (a new epoch)."""
        known = self.instances.get(beat.instance_id)
        self.instances[beat.instance_id] = InstanceView(beat, self.clock())
        return known is None or known.last.epoch != beat.epoch

    def alive(self, role: str | None = None) -> list[Heartbeat]:
        """Heartbeats of the live instances (of one role), in a stable order."""
        now = self.clock()
        return [
            v.last for _, v in sorted(self.instances.items())
            if now - v.seen_at <= self.timeout_s and (role is None or v.last.role == role)
        ]

    def forget_silent(self) -> list[Heartbeat]:
        """Remove and return the instances silent for longer than the timeout."""
        now = self.clock()
        gone = [v.last for v in self.instances.values() if now - v.seen_at > self.timeout_s]
        for beat in gone:
            del self.instances[beat.instance_id]
        return gone
