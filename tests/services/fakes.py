"""A bus double for handler unit tests: records what a service publishes; no NATS."""

from __future__ import annotations

from shared.wire.protocol import Message, Subjects


class RecordingBus:
    """Has the parts of `shared.wire.bus.Bus` that handlers use; `published` keeps (subject, message) in order."""

    def __init__(self, prefix: str = "t") -> None:
        self.subjects = Subjects(prefix)
        self.published: list[tuple[str, Message]] = []
        self.max_payload = 1 << 20

    async def publish(self, subject: str, msg: Message) -> None:
        self.published.append((subject, msg))

    def on(self, subject: str) -> list[Message]:
        return [m for s, m in self.published if s == subject]
