"""Every NATS subject under one configurable prefix, the queue groups, and what a request id may be.

Subjects that an instance publishes about itself (heartbeats, KV events, snapshots) end in `<role>.<instance_id>`, so
that NATS permissions can bind each role's credentials to its own subjects (`shared.wire.nats_auth`) and a listener can
check that a message speaks for the instance and role its subject names (`Subjects.sender_of`).
"""

from __future__ import annotations

import re
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

    def heartbeat(self, role: str, instance_id: str) -> str:
        return f"{self.prefix}.sched.heartbeat.{role}.{instance_id}"

    @property
    def heartbeat_all(self) -> str:
        return f"{self.prefix}.sched.heartbeat.>"

    @property
    def failed(self) -> str:
        """The scheduler's failures of requests whose instance was lost (only prefill and decode publish on a
        request's own stream)."""
        return f"{self.prefix}.sched.failed"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}.cancel"

    def kv_events(self, role: str, instance_id: str) -> str:
        return f"{self.prefix}.kv.events.{role}.{instance_id}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.prefix}.kv.events.>"

    def snapshot(self, role: str, instance_id: str) -> str:
        return f"{self.prefix}.snapshot.{role}.{instance_id}"

    def prefill_run(self, instance_id: str) -> str:
        return f"{self.prefix}.prefill.{instance_id}.run"

    def prefill_stage(self, instance_id: str) -> str:
        """A prefill pipeline group's stage -> the next one (`StageTask`, `StageRows`)."""
        return f"{self.prefix}.prefill.{instance_id}.stage"

    def decode_run(self, instance_id: str) -> str:
        return f"{self.prefix}.decode.{instance_id}.run"

    def decode_handoff(self, instance_id: str) -> str:
        """Hand-off streams prefill -> decode (`HandoffStart`, `KvChunk`, `FastGenProfilePart`, `HandoffEnd`)."""
        return f"{self.prefix}.decode.{instance_id}.handoff"

    def stream(self, request_id: str) -> str:
        return f"{self.prefix}.stream.{request_id}"

    def cache_put(self, shard: int) -> str:
        return f"{self.prefix}.cache.{shard}.put"

    def cache_get(self, shard: int) -> str:
        return f"{self.prefix}.cache.{shard}.get"

    def cache_has(self, shard: int) -> str:
        return f"{self.prefix}.cache.{shard}.has"

    def sender_of(self, subject: str) -> tuple[str, str] | None:
        """(role, instance_id) named by a heartbeat, KV event or snapshot subject; None for any other subject."""
        for head in (f"{self.prefix}.sched.heartbeat.", f"{self.prefix}.kv.events.", f"{self.prefix}.snapshot."):
            if subject.startswith(head):
                role, _, instance_id = subject[len(head):].partition(".")
                if role and instance_id and "." not in instance_id:
                    return role, instance_id
        return None


MAX_REQUEST_ID_LEN = 160  # a client's 128-character label, '-' and the gateway's 16 random hex digits, and room


_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def is_subject_token(text: str, max_len: int) -> bool:
    """1 to `max_len` ASCII letters, digits, '-' and '_'."""
    return 0 < len(text) <= max_len and _SUBJECT_TOKEN.fullmatch(text) is not None


def is_valid_request_id(request_id: str) -> bool:
    """Request ids become subject tokens: 1-160 of letters, digits, '-' and '_'."""
    return is_subject_token(request_id, MAX_REQUEST_ID_LEN)
