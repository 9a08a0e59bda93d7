"""One request's hand-off stream as decode receives it: `HandoffStart`, the prompt's `KvChunk`s, any
`FastGenProfilePart`s, then `HandoffEnd` (see `HandoffStart` for the order). It holds the verified parts (one
`PartAssembly` for the KV, one for the profile) and says when the stream is whole; it sends nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.wire.handoff.profile import ProfileAssembly, profile_assembly
from shared.wire.handoff.prompt import KvAssembly
from shared.wire.parts import PartError
from shared.wire.protocol import FastGenProfilePart, HandoffEnd, HandoffStart, KvChunk


class HandoffStream:
    """A request's stream from its start on.

    Args:
        start: the stream's header.
        clock: monotonic seconds (tests pass a fake).
    Raises:
        PartError: a start announcing no KV chunk.
    """

    def __init__(self, start: HandoffStart, clock: Callable[[], float] = time.monotonic) -> None:
        self.start, self.clock = start, clock
        self.kv = KvAssembly(start.request_id, start.num_kv_chunks, clock)
        self.profile: ProfileAssembly | None = None
        self.end: HandoffEnd | None = None

    @property
    def request_id(self) -> str:
        return self.start.request_id

    @property
    def num_held_bytes(self) -> int:
        return self.kv.num_held_bytes + (0 if self.profile is None else self.profile.num_held_bytes)

    def add(self, part: KvChunk | FastGenProfilePart) -> None:
        """Take one KV chunk or profile part (an identical duplicate is ignored).

        Raises:
            PartError: the stream has ended, or the part fails its checks (`shared.wire.parts.PartAssembly.add`).
        """
        if self.end is not None:
            raise PartError(f"request {self.request_id}: a {part.KIND} after the hand-off ended")
        if isinstance(part, KvChunk):
            self.kv.add(part)
        else:
            if self.profile is None:
                self.profile = profile_assembly(self.request_id, part.total, self.clock)
            self.profile.add(part)

    def finish(self, end: HandoffEnd) -> None:
        """The stream's last message: every part it announced must be in, as the stream arrives in order.

        Raises:
            PartError: KV chunks or profile parts missing (lost on the way), or profile parts nobody announced.
        """
        self.kv.check_complete()
        num_profile_parts = 0 if self.profile is None else self.profile.num_received
        if num_profile_parts != end.num_profile_parts:
            raise PartError(f"request {self.request_id}: {num_profile_parts} of {end.num_profile_parts} FastGen "
                            "profile parts arrived")
        if self.profile is not None:
            self.profile.check_complete()
        self.end = end

    @property
    def has_begun(self) -> bool:
        """Some KV has arrived: before that, the request waits in prefill's queue (its stream opens at admission)."""
        return self.kv.num_received > 0

    def stalled_s(self) -> float:
        """Seconds since the stream's last new part (or its start, which opened the KV assembly)."""
        last_s = self.kv.last_part_s if self.profile is None else max(self.kv.last_part_s, self.profile.last_part_s)
        return self.clock() - last_s

    def describe_stall(self) -> str:
        """What the stream still waits for, for the error a stall becomes."""
        kv = self.kv
        if not kv.is_complete:
            return f"{kv.total - kv.num_received} of {kv.total} KV chunks missing"
        return "the prompt's KV arrived, the hand-off's end did not"
