"""Every NATS subject under one configurable prefix, the queue groups, and what a request id may be."""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_QUEUE = "prefill"  # queue group of prefill instances for unaddressed work
SCHEDULER_QUEUE = "scheduler"  # one active scheduler answers each submit


@dataclass(frozen=True)
class Subjects:
    """Every NATS subject, under one configurable prefix (`TSUKIMI_SUBJECT_PREFIX`)."""

    prefix: str = "tsukimi"

    @property
    def submit(self) -> str:
        return f"{self.prefix}.sched.submit"

    @property
    def heartbeat(self) -> str:
        return f"{self.prefix}.sched.heartbeat"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}.cancel"

    def kv_events(self, instance_id: str) -> str:
        return f"{self.prefix}.kv.events.{instance_id}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.prefix}.kv.events.>"

    def snapshot(self, instance_id: str) -> str:
        return f"{self.prefix}.snapshot.{instance_id}"

    def prefill_run(self, instance_id: str) -> str:
        return f"{self.prefix}.prefill.{instance_id}.run"

    def decode_run(self, instance_id: str) -> str:
        return f"{self.prefix}.decode.{instance_id}.run"

    def decode_kv(self, instance_id: str) -> str:
        return f"{self.prefix}.decode.{instance_id}.kv"

    def stream(self, request_id: str) -> str:
        return f"{self.prefix}.stream.{request_id}"

    def cache_put(self, shard: int) -> str:
        return f"{self.prefix}.cache.{shard}.put"

    def cache_get(self, shard: int) -> str:
        return f"{self.prefix}.cache.{shard}.get"

    def cache_has(self, shard: int) -> str:
        return f"{self.prefix}.cache.{shard}.has"


def is_valid_request_id(request_id: str) -> bool:
    """Request ids become subject tokens: 1-128 of letters, digits, '-' and '_'."""
    return 0 < len(request_id) <= 128 and all(c.isascii() and (c.isalnum() or c in "-_") for c in request_id)
