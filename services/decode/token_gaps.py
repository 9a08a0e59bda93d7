"""The gaps between a request's tokens as this decode instance's engine made them, and Mooncake's time between
tokens (TBT) over them: what the engine delivered, before this host's own delays in passing tokens on and before
NATS, the gateway and the client add theirs. It does not judge SLOs (the scheduler predicts TBT; clients measure
theirs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def slowest_tenth_mean(gaps: Sequence[float]) -> float:
    """Mooncake's TBT: the mean of the ceil(k/10) largest of k gaps (the definition loadgen's `tbt_s` measures at
    the client); 0 without gaps."""
    if not gaps:
        return 0.0
    num_slowest = (len(gaps) + 9) // 10
    return sum(sorted(gaps, reverse=True)[:num_slowest]) / num_slowest


class TokenGaps:
    """Per running request, when its last token was made and the gaps before it.

    Args:
        clock: seconds, on the clock of the runner's `tokens_ready_at` (`time.perf_counter`).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._last: dict[str, float] = {}
        self._gaps: dict[str, list[float]] = {}

    def __len__(self) -> int:
        return len(self._last)

    def made(self, request_id: str, at: float | None = None) -> None:
        """A token of `request_id` was made `at` (None: now)."""
        now = self.clock() if at is None else at
        last = self._last.get(request_id)
        self._last[request_id] = now
        if last is None:
            self._gaps[request_id] = []
        else:
            self._gaps[request_id].append(now - last)

    def finish(self, request_id: str) -> float | None:
        """The request's TBT in seconds (None when no two events went out), and forget it."""
        gaps = self._gaps.pop(request_id, None)
        self._last.pop(request_id, None)
        return slowest_tenth_mean(gaps) if gaps else None

    def forget(self, request_id: str) -> None:
        self._gaps.pop(request_id, None)
        self._last.pop(request_id, None)
