"""The prefill's local prefix cache as seen from outside: its block manager's changes as numbered `KvEvent`s, and the
`Snapshot` a listener resyncs from.

It only collects, numbers and mirrors; the service publishes. No NATS here.
"""

from __future__ import annotations

import threading

from shared.engine.blocks import REMOVED, STORED
from shared.wire.protocol import KvEvent, Role, Snapshot


class KvEventLog:
    """Collects `BlockManager` events (pass `record` as its `on_event`) and turns them into gapless `KvEvent`s.

    `record` runs on the engine thread; `take` and `snapshot` on the event loop. Events are numbered when taken, in
    the order they happened, consecutive ones of the same kind merged into one (so a step's changes go out
    together). The log mirrors the index the events describe, so a snapshot matches its `seq` exactly.

    Args:
        instance_id: whose cache this is.
        epoch: the instance's epoch (the heartbeat's); numbering starts at 0 in it.
        role: the instance's role, which every event states (its subject names it too).
    """

    def __init__(self, instance_id: str, epoch: int, role: str = Role.PREFILL) -> None:
        self.instance_id, self.epoch, self.role = instance_id, epoch, str(role)
        self.next_seq = 0
        self._lock = threading.Lock()
        self._pending: list[tuple[str, list[int]]] = []
        self._hashes: set[int] = set()  # the index as of event next_seq - 1

    def record(self, kind: str, block_hashes: list[int]) -> None:
        """The block manager's hook: blocks were registered (`STORED`) or evicted (`REMOVED`)."""
        with self._lock:
            if self._pending and self._pending[-1][0] == kind:
                self._pending[-1][1].extend(block_hashes)
            else:
                self._pending.append((kind, list(block_hashes)))

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
            events.append(KvEvent(self.instance_id, self.epoch, self.next_seq, kind, block_hashes, self.role))
            self.next_seq += 1
        self._pending = []
        return events
