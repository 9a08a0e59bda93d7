"""A cache's changes as numbered `KvEvent`s and the `Snapshot` a listener resyncs from: the one log that prefill's
local prefix cache and every cache-store shard keep, and its publisher.

Events are numbered per (instance, epoch) when taken, in the order they happened, gapless: a listener that sees a gap
(a lost message) asks for a snapshot. The log mirrors the index its events describe, so a snapshot matches its `seq`
exactly.
"""

from __future__ import annotations

import asyncio
import threading

from shared.wire.bus import Bus
from shared.wire.log import get_logger
from shared.wire.protocol import KvEvent, Snapshot
from shared.wire.protocol.messages import CLEARED, REMOVED, STORED

log = get_logger(__name__)
MAX_EVENT_HASHES = 8192  # hashes per KvEvent (a restarted store re-announces a whole SSD tier: keep messages small)


class KvEventLog:
    """Collects a cache's changes and turns them into gapless `KvEvent`s.

    `record` may run on any thread (prefill's engine thread: the block manager's `on_event`); `take` and `snapshot`
    run on the event loop. Consecutive changes of one kind merge into one event (so a step's changes go out
    together), split at `max_hashes` hashes an event.

    Args:
        instance_id: whose cache this is.
        epoch: the instance's epoch (its heartbeat's); numbering starts at 0 in it.
        role: the instance's role, which every event states (its subject names it too).
        max_hashes: the most hashes one event carries.
    """

    def __init__(self, instance_id: str, epoch: int, role: str, max_hashes: int = MAX_EVENT_HASHES) -> None:
        self.instance_id, self.epoch, self.role, self.max_hashes = instance_id, epoch, str(role), max_hashes
        self.next_seq = 0
        self._lock = threading.Lock()
        self._pending: list[tuple[str, list[int]]] = []
        self._hashes: set[int] = set()  # the index as of event next_seq - 1

    def record(self, kind: str, block_hashes: list[int]) -> None:
        """Blocks were stored or removed (none: nothing to say), or everything `cleared` (hashes ignored)."""
        if kind != CLEARED and not block_hashes:
            return
        with self._lock:
            if kind != CLEARED and self._pending and self._pending[-1][0] == kind:
                self._pending[-1][1].extend(block_hashes)
            else:
                self._pending.append((kind, [] if kind == CLEARED else list(block_hashes)))

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def take(self) -> list[KvEvent]:
        """The events recorded since the last take, numbered; publish them in this order."""
        with self._lock:
            return self._take()

    def snapshot(self) -> tuple[Snapshot, list[KvEvent]]:
        """Every cached hash as of the last numbered event, and the events numbered on the way (publish them)."""
        with self._lock:
            events = self._take()
            return Snapshot(self.instance_id, self.epoch, self.next_seq - 1, sorted(self._hashes)), events

    def _take(self) -> list[KvEvent]:
        events = []
        for kind, block_hashes in self._pending:
            if kind == STORED:
                self._hashes.update(block_hashes)
            elif kind == REMOVED:
                self._hashes.difference_update(block_hashes)
            elif kind == CLEARED:
                self._hashes.clear()
            chunks = [block_hashes[i : i + self.max_hashes] for i in range(0, len(block_hashes), self.max_hashes)]
            for chunk in chunks or [[]]:  # `cleared` alone has no hashes
                events.append(KvEvent(self.instance_id, self.epoch, self.next_seq, kind, chunk, self.role))
                self.next_seq += 1
        self._pending = []
        return events


class KvEventPublisher:
    """Publishes a log's events on `subject`, one flush at a time and in order (a lost one is a gap listeners
    notice), and answers snapshots consistently with them.

    Args:
        bus: the connection.
        events: the log.
        subject: the instance's `kv.events.<role>.<id>`.
    """

    def __init__(self, bus: Bus, events: KvEventLog, subject: str) -> None:
        self.bus, self.events, self.subject = bus, events, subject
        self._lock = asyncio.Lock()

    async def flush(self) -> None:
        """Publish what was recorded since the last flush."""
        async with self._lock:
            await self._publish(self.events.take())

    async def snapshot(self) -> Snapshot:
        """The snapshot as of the last event, once the events numbered on the way are out."""
        async with self._lock:
            snapshot, events = self.events.snapshot()
            await self._publish(events)
        return snapshot

    async def _publish(self, events: list[KvEvent]) -> None:
        for event in events:
            try:
                await self.bus.publish(self.subject, event)
            except Exception as exc:  # a closed connection or a full buffer: the gap makes listeners resync
                log.warning("kv event lost", seq=event.seq, kind=event.kind, error=str(exc))
