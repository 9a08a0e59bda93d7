"""Load generator metrics on hand-worked records: TTFT, E2E, ITL, TPOT, Mooncake TBT, SLOs, the run summary."""

from __future__ import annotations

import pytest

from loadgen.metrics import (
    LatencyStats,
    Slo,
    cache_hit_rate,
    e2e_s,
    itls_s,
    meets_slo,
    percentile,
    summarize,
    tbt_s,
    tpot_s,
    ttft_s,
)
from loadgen.record import RequestRecord


def _record(
    request_id: int = 0,
    send_s: float = 1.0,
    chunk_times_s: list[float] | None = None,
    done_s: float | None = None,
    status: int | None = 200,
    error: str | None = None,
    num_output_tokens: int | None = None,
    **kwargs: object,
) -> RequestRecord:
    chunks = list(chunk_times_s or [])
    return RequestRecord(
        request_id=request_id,
        arrival_s=send_s,
        send_s=send_s,
        chunk_times_s=chunks,
        done_s=done_s if done_s is not None else (chunks[-1] if chunks else send_s),
        status=status,
        error=error,
        num_output_tokens=len(chunks) if num_output_tokens is None else num_output_tokens,
        **kwargs,  # type: ignore[arg-type]
    )


def test_per_request_latencies_from_chunk_times() -> None:
    record = _record(send_s=1.0, chunk_times_s=[1.5, 1.6, 2.1, 2.2], done_s=2.3)
    assert ttft_s(record) == pytest.approx(0.5)
    assert e2e_s(record) == pytest.approx(1.3)
    assert itls_s(record) == pytest.approx([0.1, 0.5, 0.1])
    assert tpot_s(record) == pytest.approx((1.3 - 0.5) / 3)
    assert tbt_s(itls_s(record)) == pytest.approx(0.5)


def test_tpot_uses_the_reported_output_tokens_not_the_chunks() -> None:
    record = _record(send_s=0.0, chunk_times_s=[1.0, 2.0], done_s=2.0, num_output_tokens=11)  # 5 tokens a chunk
    assert tpot_s(record) == pytest.approx((2.0 - 1.0) / 10)


def test_tpot_is_undefined_for_one_token_and_latencies_for_failures() -> None:
    assert tpot_s(_record(chunk_times_s=[1.2])) is None
    failed = _record(chunk_times_s=[1.2, 1.3], error="HTTP 500: boom", status=500)
    assert ttft_s(failed) is None and e2e_s(failed) is None and tpot_s(failed) is None


def test_ttft_of_an_answer_without_content_is_its_end() -> None:
    assert ttft_s(_record(send_s=1.0, chunk_times_s=[], done_s=1.75, num_output_tokens=1)) == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("gaps", "expected"),
    [
        ([], 0.0),
        ([0.3], 0.3),
        ([0.1, 0.1, 0.5, 0.1], 0.5),
        ([float(g) for g in range(1, 11)], 10.0),  # 10 gaps: the largest
        ([float(g) for g in range(1, 12)], (11 + 10) / 2),  # 11 gaps: the two largest
        ([float(g) for g in range(1, 21)], (20 + 19) / 2),  # 20 gaps: the two largest
        ([float(g) for g in range(1, 31)], (30 + 29 + 28) / 3),  # 30 gaps: three (0.1 * 30 rounds above 3)
        ([float(g) for g in range(1, 32)], (31 + 30 + 29 + 28) / 4),  # 31 gaps: four
    ],
)
def test_tbt_is_the_mean_of_the_slowest_tenth_of_gaps(gaps: list[float], expected: float) -> None:
    assert tbt_s(gaps) == pytest.approx(expected)


def test_percentiles_interpolate_linearly() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)
    stats = LatencyStats.of_seconds([0.004, 0.001, 0.003, 0.002])
    assert (stats.count, stats.mean_ms, stats.median_ms, stats.p90_ms) == (4, pytest.approx(2.5), 2.5, 3.7)


def test_slo_needs_completion_and_every_given_objective() -> None:
    record = _record(send_s=0.0, chunk_times_s=[0.25, 0.375, 0.75], done_s=0.75)  # TTFT 250 ms, TBT 375 ms
    assert meets_slo(record, Slo())
    assert meets_slo(record, Slo(ttft_ms=250, tbt_ms=375))  # bounds are inclusive
    assert not meets_slo(record, Slo(ttft_ms=249))
    assert not meets_slo(record, Slo(tbt_ms=374))
    assert not meets_slo(_record(chunk_times_s=[1.1], status=429, error="HTTP 429: busy"), Slo())


def _run_records() -> list[RequestRecord]:
    """Six sent requests over 10 s: two meet TTFT 1 s and TBT 100 ms, one is slow to start, one stutters,
    one is rejected, one fails; one more was never sent."""
    return [
        _record(0, 0.0, [0.5, 0.55, 0.60], 0.6, num_prompt_tokens=100, num_cached_tokens=50),
        _record(1, 1.0, [1.5, 1.58], 1.6, num_prompt_tokens=100, num_cached_tokens=0),
        _record(2, 2.0, [4.0, 4.05], 4.1, num_prompt_tokens=200),  # TTFT 2 s
        _record(3, 3.0, [3.2, 3.25, 3.75], 3.8),  # TBT 500 ms
        _record(4, 4.0, [], 4.1, status=429, error="HTTP 429: overloaded"),
        _record(5, 5.0, [5.5], 10.0, status=None, error="timed out after 5 s"),
        RequestRecord(6, 6.0),
    ]


def test_summary_counts_rates_and_slo_shares() -> None:
    summary = summarize(_run_records(), Slo(ttft_ms=1000, tbt_ms=100))
    assert (summary.num_sent, summary.num_completed, summary.num_rejected, summary.num_failed) == (6, 4, 1, 1)
    assert summary.duration_s == pytest.approx(10.0)
    assert summary.request_throughput == pytest.approx(0.4)
    assert summary.output_token_throughput == pytest.approx(10 / 10.0)  # 3 + 2 + 2 + 3 tokens
    assert summary.num_meeting_slo == 2
    assert summary.goodput == pytest.approx(0.2)
    assert summary.effective_capacity == pytest.approx(2 / 6)  # rejected and failed count as misses
    assert summary.ttft_attainment == pytest.approx(3 / 6)
    assert summary.tbt_attainment == pytest.approx(3 / 6)
    assert summary.ttft.count == 4 and summary.ttft.median_ms == pytest.approx(500.0)
    assert summary.tbt.count == 4 and summary.tbt.mean_ms == pytest.approx((50 + 80 + 50 + 500) / 4)
    assert summary.itl.count == 6 and summary.tpot.count == 4
    assert summary.errors == {"HTTP 429: overloaded": 1, "timed out after 5 s": 1}


def test_without_slos_every_completed_request_counts() -> None:
    summary = summarize(_run_records())
    assert summary.goodput == summary.request_throughput
    assert summary.effective_capacity == pytest.approx(4 / 6)
    assert summary.ttft_attainment is None and summary.tbt_attainment is None


def test_cache_hit_rate_counts_only_reporting_requests() -> None:
    assert cache_hit_rate(_run_records()) == pytest.approx(50 / 200)
    assert summarize(_run_records()).cache_hit_rate == pytest.approx(50 / 200)
    assert cache_hit_rate([_record(chunk_times_s=[1.1])]) is None


def test_an_empty_run_has_no_rates() -> None:
    summary = summarize([])
    assert summary.num_sent == 0 and summary.request_throughput == 0.0 and summary.effective_capacity is None
    assert summary.ttft.count == 0 and summary.ttft.mean_ms is None
