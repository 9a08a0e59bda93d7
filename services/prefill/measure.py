"""What the prefill measures for the Conductor's cost models besides its steps (`services.common.step_samples`): the
cache-store fetch bandwidth as a moving average."""

from __future__ import annotations


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
