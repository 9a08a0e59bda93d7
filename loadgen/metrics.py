"""Latency and throughput metrics of a run, as pure functions of request records (vllm bench serve semantics
plus the Mooncake paper's TBT and effective request capacity; DESIGN.md section 8). No I/O here.

Percentiles interpolate linearly between the two nearest ranks (numpy's default `method="linear"`): the p-th
percentile of sorted x[0..n-1] is x[i] + f * (x[i+1] - x[i]) with i + f = p/100 * (n-1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from loadgen.record import RequestRecord


@dataclass(frozen=True)
class Slo:
    """Service-level objectives; None means no objective on that metric."""

    ttft_ms: float | None = None
    tbt_ms: float | None = None

    def describe(self) -> str:
        parts = [
            f"{name} <= {value:g} ms"
            for name, value in (("TTFT", self.ttft_ms), ("TBT", self.tbt_ms))
            if value is not None
        ]
        return ", ".join(parts) if parts else "none"


def ttft_s(record: RequestRecord) -> float | None:
    """First content chunk - send; a completed answer without content chunks counts its end. None when not
    completed."""
    if not record.is_completed:
        return None
    assert record.send_s is not None and record.done_s is not None
    first = record.chunk_times_s[0] if record.chunk_times_s else record.done_s
    return first - record.send_s


def e2e_s(record: RequestRecord) -> float | None:
    """End of the answer - send; None when not completed."""
    if not record.is_completed:
        return None
    assert record.send_s is not None and record.done_s is not None
    return record.done_s - record.send_s


def itls_s(record: RequestRecord) -> list[float]:
    """Inter-token latencies: the gaps between consecutive content chunks."""
    times = record.chunk_times_s
    return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


def tpot_s(record: RequestRecord) -> float | None:
    """(E2E - TTFT) / (output tokens - 1); None when not completed or with fewer than 2 output tokens."""
    e2e, ttft = e2e_s(record), ttft_s(record)
    if e2e is None or ttft is None or record.num_output_tokens < 2:
        return None
    return (e2e - ttft) / (record.num_output_tokens - 1)


def tbt_s(gaps: Sequence[float]) -> float:
    """Mooncake's time between tokens: the mean of the slowest 10% of a request's gaps, i.e. of the ceil(k/10)
    largest of k gaps (1-10 gaps: the largest; 11-20: the two largest); 0 without gaps."""
    if not gaps:
        return 0.0
    num_slowest = (len(gaps) + 9) // 10  # ceil(k / 10) without float rounding (0.1 * 30 > 3)
    return float(np.mean(sorted(gaps, reverse=True)[:num_slowest]))


def meets_ttft(record: RequestRecord, slo: Slo) -> bool:
    """Completed, and TTFT within the SLO when there is one."""
    ttft = ttft_s(record)
    return ttft is not None and (slo.ttft_ms is None or ttft * 1000.0 <= slo.ttft_ms)


def meets_tbt(record: RequestRecord, slo: Slo) -> bool:
    """Completed, and TBT within the SLO when there is one."""
    return record.is_completed and (slo.tbt_ms is None or tbt_s(itls_s(record)) * 1000.0 <= slo.tbt_ms)


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """Completed and every given SLO holds."""
    return meets_ttft(record, slo) and meets_tbt(record, slo)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation (see the module docstring). Raises ValueError when empty."""
    if len(values) == 0:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, p90 and p99 in milliseconds of `count` values (all None when count is 0)."""

    count: int = 0
    mean_ms: float | None = None
    median_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> LatencyStats:
        if not values_s:
            return cls()
        ms = [v * 1000.0 for v in values_s]
        return cls(len(ms), float(np.mean(ms)), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True)
class Summary:
    """A run's figures. Rates are per second of `duration_s` (first send to the last answer's end, whatever its
    outcome); shares are of all sent requests (rejected and failed included); None where undefined."""

    slo: Slo = field(default_factory=Slo)
    num_sent: int = 0
    num_completed: int = 0
    num_rejected: int = 0
    num_failed: int = 0
    num_meeting_slo: int = 0
    duration_s: float = 0.0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    request_throughput: float = 0.0
    output_token_throughput: float = 0.0
    goodput: float = 0.0
    effective_capacity: float | None = None
    ttft_attainment: float | None = None
    tbt_attainment: float | None = None
    cache_hit_rate: float | None = None
    ttft: LatencyStats = field(default_factory=LatencyStats)
    tpot: LatencyStats = field(default_factory=LatencyStats)
    itl: LatencyStats = field(default_factory=LatencyStats)
    e2e: LatencyStats = field(default_factory=LatencyStats)
    tbt: LatencyStats = field(default_factory=LatencyStats)
    errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], slo: Slo | None = None) -> Summary:
    """The summary of a run's records (unsent records are ignored)."""
    slo = slo or Slo()
    sent = [r for r in records if r.send_s is not None]
    completed = [r for r in sent if r.is_completed]
    duration = _duration_s(sent)
    num_meeting = sum(meets_slo(r, slo) for r in completed)
    num_output_tokens = sum(r.num_output_tokens for r in completed)
    gaps_by_request = [itls_s(r) for r in completed]
    return Summary(
        slo=slo,
        num_sent=len(sent),
        num_completed=len(completed),
        num_rejected=sum(r.is_rejected for r in sent),
        num_failed=sum(r.is_failed for r in sent),
        num_meeting_slo=num_meeting,
        duration_s=duration,
        num_prompt_tokens=sum(r.num_prompt_tokens or 0 for r in completed),
        num_output_tokens=num_output_tokens,
        request_throughput=_per_second(len(completed), duration),
        output_token_throughput=_per_second(num_output_tokens, duration),
        goodput=_per_second(num_meeting, duration),
        effective_capacity=_share(num_meeting, len(sent)),
        ttft_attainment=_attainment([meets_ttft(r, slo) for r in completed], len(sent), slo.ttft_ms),
        tbt_attainment=_attainment([meets_tbt(r, slo) for r in completed], len(sent), slo.tbt_ms),
        cache_hit_rate=cache_hit_rate(completed),
        ttft=LatencyStats.of_seconds(_defined(ttft_s(r) for r in completed)),
        tpot=LatencyStats.of_seconds(_defined(tpot_s(r) for r in completed)),
        itl=LatencyStats.of_seconds([gap for gaps in gaps_by_request for gap in gaps]),
        e2e=LatencyStats.of_seconds(_defined(e2e_s(r) for r in completed)),
        tbt=LatencyStats.of_seconds([tbt_s(gaps) for gaps in gaps_by_request if gaps]),
        errors=dict(Counter(r.error for r in sent if r.error is not None).most_common(5)),
    )


def cache_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """Sum of cached prompt tokens / sum of prompt tokens, over the records whose server reported both."""
    reported = [r for r in records if r.num_cached_tokens is not None and r.num_prompt_tokens]
    if not reported:
        return None
    return sum(r.num_cached_tokens or 0 for r in reported) / sum(r.num_prompt_tokens or 0 for r in reported)


def _duration_s(sent: Sequence[RequestRecord]) -> float:
    ends = [r.done_s for r in sent if r.done_s is not None]
    if not sent or not ends:
        return 0.0
    return max(ends) - min(r.send_s for r in sent if r.send_s is not None)


def _per_second(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def _share(count: int, total: int) -> float | None:
    return count / total if total else None


def _attainment(is_met: list[bool], num_sent: int, slo_ms: float | None) -> float | None:
    return _share(sum(is_met), num_sent) if slo_ms is not None else None


def _defined(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]
