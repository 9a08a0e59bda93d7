"""Step timings an engine service hands to the Conductor's cost models at each heartbeat. Thread-safe: the engine
thread adds, the heartbeat takes."""

from __future__ import annotations

import threading
from collections import deque

from shared.engine.engine import StepStats


class StepSamples:
    """Prompt steps since the last `take`, as `[num_new_tokens, attention_work, seconds]` (see `Heartbeat.samples`).

    Args:
        max_samples: the newest ones kept when nobody takes them (heartbeats failing, say).
    """

    def __init__(self, max_samples: int = 512) -> None:
        self._samples: deque[list[float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, stats: StepStats) -> None:
        with self._lock:
            self._samples.append([float(stats.num_new_tokens), float(stats.attention_work), stats.seconds])

    def take(self) -> list[list[float]]:
        with self._lock:
            samples = list(self._samples)
            self._samples.clear()
        return samples
