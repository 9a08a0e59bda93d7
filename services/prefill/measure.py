"""What the prefill measures for the Conductor's cost models: step samples, handed over at each heartbeat, and the
cache-store fetch bandwidth as a moving average. Plain numbers; thread-safe where the engine thread writes."""

from __future__ import annotations

import threading
from collections import deque

from shared.engine.engine import StepStats


class StepSamples:
    """Engine steps since the last `take`, as `[num_new_tokens, attention_work, seconds]` (see `Heartbeat.samples`).

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


class MovingRate:
    """An exponential moving average of measured rates (bytes per second, say); 0.0 until the first measurement.

    Args:
        weight: how much each new measurement counts, in (0, 1].
    Raises:
        ValueError: a weight outside (0, 1].
    """

    def __init__(self, weight: float = 0.25) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must lie in (0, 1], got {weight}")
        self.weight = weight
        self.value = 0.0

    def add(self, amount: float, seconds: float) -> None:
        """One measurement: `amount` moved in `seconds` (ignored when either is not positive)."""
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value == 0.0 else self.weight * rate + (1 - self.weight) * self.value
