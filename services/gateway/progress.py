"""When to give up on a request that has gone quiet. Pure logic with a clock; session.py feeds it.

A request makes progress when a stream event arrives, or when some live instance's latest heartbeat lists it (it is
queued, computing, waiting for KV or running there). Without either for `progress_timeout_s` it was lost (an instance
dropped it and its failure event never came); with no event at all for `request_timeout_s` the gateway gives up.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

MAX_CHECK_S = 1.0  # how often a quiet request looks at the heartbeats; they change every TSUKIMI_HEARTBEAT_S


class Verdict(enum.Enum):
    WAIT = "wait"
    LOST = "lost"  # no event, and no instance holds it: 503
    SILENT = "silent"  # held, but no event for the whole request timeout: 504


class ProgressWatch:
    """Args:
    progress_timeout_s: longest time with neither an event nor an instance holding the request.
    request_timeout_s: longest time without an event.
    clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self, progress_timeout_s: float, request_timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.progress_timeout_s, self.request_timeout_s, self.clock = progress_timeout_s, request_timeout_s, clock
        self.event_at = self.held_at = clock()

    def saw_event(self) -> None:
        self.event_at = self.held_at = self.clock()

    def saw_held(self) -> None:
        self.held_at = self.clock()

    def wait_s(self) -> float:
        """How long to wait for the next event before looking at the heartbeats again."""
        now = self.clock()
        until_lost = self.held_at + self.progress_timeout_s - now
        until_silent = self.event_at + self.request_timeout_s - now
        return max(0.0, min(MAX_CHECK_S, self.progress_timeout_s / 4, until_lost, until_silent))

    def verdict(self) -> Verdict:
        now = self.clock()
        if now - self.event_at >= self.request_timeout_s:
            return Verdict.SILENT
        if now - self.held_at >= self.progress_timeout_s:
            return Verdict.LOST
        return Verdict.WAIT
