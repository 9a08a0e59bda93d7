"""Effective request capacity from a load sweep: the load at which the share of requests meeting the SLOs falls to a
threshold (90%), interpolated between the swept loads, and the ratio of two systems' capacities. Pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

THRESHOLD = 0.9  # a system "serves" a load while at least this share of requests meets every SLO


@dataclass(frozen=True)
class Capacity:
    """The highest load (requests/s) served within the SLOs, or a bound on it.

    Attributes:
        rate: the capacity; with `bound` ">=" the sweep never reached it (every load was served), with "<" even the
            lowest load was not served (then it is that lowest load).
        bound: "=", ">=" or "<".
    """

    rate: float
    bound: str = "="

    def __str__(self) -> str:
        prefix = "" if self.bound == "=" else f"{self.bound} "
        return f"{prefix}{self.rate:.2f}"


def capacity(points: Sequence[tuple[float, float]], threshold: float = THRESHOLD) -> Capacity:
    """From (load, share meeting the SLOs) points: the load where the share first falls below `threshold`, linearly
    interpolated from the last load that met it.

    Raises:
        ValueError: no points.
    """
    if not points:
        raise ValueError("capacity of an empty sweep")
    ordered = sorted(points)
    if ordered[0][1] < threshold:
        return Capacity(ordered[0][0], "<")
    for (rate0, share0), (rate1, share1) in zip(ordered, ordered[1:], strict=False):
        if share1 < threshold:
            return Capacity(rate0 + (rate1 - rate0) * (share0 - threshold) / (share0 - share1))
    return Capacity(ordered[-1][0], ">=")


@dataclass(frozen=True)
class Ratio:
    """`value` = tsukimi's capacity / the baseline's, and whether that is exact, a lower or an upper bound."""

    value: float
    bound: str = "="

    def __str__(self) -> str:
        prefix = "" if self.bound == "=" else f"{self.bound} "
        return f"{prefix}{self.value:.2f}x"


def capacity_ratio(ours: Capacity, baseline: Capacity) -> Ratio:
    """Our capacity over the baseline's. Bounds carry over: ours at least a, the baseline below b -> at least a/b;
    the other way round -> at most; both censored the same way (both served everything, or nothing) -> "?"."""
    value = ours.rate / baseline.rate
    if ours.bound == "=" and baseline.bound == "=":
        return Ratio(value)
    if ours.bound in ("=", ">=") and baseline.bound in ("=", "<"):
        return Ratio(value, ">=")
    if ours.bound in ("=", "<") and baseline.bound in ("=", ">="):
        return Ratio(value, "<=")
    return Ratio(value, "?")
