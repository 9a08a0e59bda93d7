"""A bus double for handler unit tests: records what a service publishes; no NATS."""

from __future__ import annotations

from shared.wire.bus import BusError
from shared.wire.protocol import Message, Snapshot, SnapshotRequest, Subjects


class RecordingBus:
    """Has the parts of `shared.wire.bus.Bus` that handlers use; `published` keeps (subject, message) in order."""

    def __init__(self, prefix: str = "t") -> None:
        self.subjects = Subjects(prefix)
        self.published: list[tuple[str, Message]] = []
        self.max_payload = 1 << 20
        self.snapshots: dict[str, Snapshot] = {}  # what a snapshot request answers; others: no responders
        self.requested: list[tuple[str, Message]] = []

    async def request(self, subject: str, msg: Message, expected: type[Message], timeout_s: float = 2.0) -> Message:
        self.requested.append((subject, msg))
        if isinstance(msg, SnapshotRequest) and msg.instance_id in self.snapshots:
            return self.snapshots[msg.instance_id]
        raise BusError(f"no responders on {subject}")

    async def publish(self, subject: str, msg: Message) -> None:
        self.published.append((subject, msg))

    def on(self, subject: str) -> list[Message]:
        return [m for s, m in self.published if s == subject]
