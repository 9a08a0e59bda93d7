"""The long-context experiment's pure parts (issue 22, Fig. 12): the trace it replays (Poisson at 1 request/s, half of
each prompt a shared prefix), the P90 figures of a run against the limits, the rate search and what capacity it
reports, the report's table, and the command line's refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from loadgen.record import RequestRecord
from shared.tools.experiment import main
from shared.tools.experiment.long_context import (
    COLOCATED,
    CPP,
    NO_CPP,
    Limits,
    Point,
    capacity,
    point,
    search_rate,
    unit_rate_trace,
)
from shared.tools.experiment.long_context_report import write_long_context_report


def test_the_trace_arrives_at_one_request_a_second_with_half_of_each_prompt_shared() -> None:
    lines = unit_rate_trace(16_384, 2_000, seed=3)
    times = [line["timestamp"] / 1000 for line in lines]
    assert times[0] == 0 and times == sorted(times)
    assert 0.95 < times[-1] / (len(times) - 1) < 1.05  # exponential gaps of mean 1 s
    assert all(line["input_length"] == 16_384 and line["output_length"] == 512 for line in lines)
    assert all(len(line["hash_ids"]) == 32 for line in lines)
    prefixes = {tuple(line["hash_ids"][:16]) for line in lines}
    assert len(prefixes) == 4  # four shared prefixes of 16 blocks
    own = [block for line in lines for block in line["hash_ids"][16:]]
    assert len(own) == len(set(own)) and not set(own) & {b for p in prefixes for b in p}
    assert unit_rate_trace(16_384, 50, seed=3) == lines[:50]  # the same draws: a run repeats
    with pytest.raises(ValueError, match="reuse share"):
        unit_rate_trace(16_384, 10, reuse=1.0)


def _record(ttft: float, gap: float, completed: bool = True) -> RequestRecord:
    chunks = [ttft + i * gap for i in range(20)]
    return RequestRecord(request_id="r", arrival_s=0.0, input_len=1, output_len=20, send_s=0.0,
                         chunk_times_s=chunks if completed else [], done_s=chunks[-1] if completed else None,
                         status=200 if completed else 503, error=None if completed else "stopped",
                         num_prompt_tokens=1, num_output_tokens=20 if completed else 0)


def test_a_point_holds_the_p90s_to_the_limits_and_a_failure_to_none() -> None:
    limits = Limits(ttft_s=1.0, tbt_s=0.02)  # P90 TTFT <= 10 s, P90 TBT <= 100 ms
    fast = [_record(1.0 + i * 0.1, 0.02) for i in range(10)]
    assert point(2.0, fast, limits).meets
    slow_first = [_record(12.0, 0.02)] * 2 + fast[:8]
    p = point(2.0, slow_first, limits)
    assert not p.meets and p.p90_ttft_s == pytest.approx(12.0)
    assert not point(2.0, fast[:9] + [_record(1.0, 0.2)] * 2, limits).meets  # TBT beyond 5x
    failed = point(2.0, fast + [_record(1.0, 0.02, completed=False)], limits)
    assert not failed.meets and failed.num_failed == 1
    none = point(2.0, [_record(1.0, 0.02, completed=False)], limits)
    assert none.p90_ttft_s == math.inf and not none.meets


@pytest.mark.parametrize("start", [0.1, 3.0, 50.0])
def test_the_search_brackets_then_bisects_to_the_highest_rate_that_meets_the_limits(start: float) -> None:
    measured: list[float] = []

    def measure(rate: float) -> Point:
        measured.append(rate)
        return Point(rate, rate, 0.0, 0, rate <= 3.3)

    points = search_rate(measure, start, steps=4)
    rate, bound = capacity(points)
    assert bound == "=" and 3.3 / 2 ** (1 / 16) <= rate <= 3.3
    assert len(points) == len(measured) <= 12 + 4


def test_capacity_says_when_the_search_never_bracketed() -> None:
    assert capacity([Point(1.0, 0, 0, 0, True), Point(2.0, 0, 0, 0, True)]) == (2.0, ">=")
    assert capacity([Point(1.0, 0, 0, 0, False), Point(0.5, 0, 0, 0, False)]) == (0.5, "<")
    # a rate that failed below one that met: the capacity stops below the failure
    assert capacity([Point(1.0, 0, 0, 0, True), Point(2.0, 0, 0, 0, False), Point(3.0, 0, 0, 0, True)]) == (1.0, "=")
    assert search_rate(lambda r: Point(r, 0, 0, 0, True), 1.0, 3)[-1].rate == 2.0**12


def _system(rate: float, bound: str = "=") -> dict[str, object]:
    return {"capacity_rps": rate, "bound": bound, "over_colocated": None,
            "points": [{"rate": rate, "p90_ttft_s": 1.0, "p90_tbt_s": 0.05, "num_failed": 0, "meets": True}]}


def test_the_report_sets_each_system_beside_the_baseline(tmp_path: Path) -> None:
    results = {
        "profile": "llama3-70b-8xa800", "output_tokens": 512, "num_prefixes": 4, "num_requests": 300, "steps": 3,
        "limits": {"ttft_factor": 10.0, "tbt_factor": 5.0}, "paper_gain_range": [1.5, 6.25],
        "lengths": {"16384": {"single_ttft_s": 2.15, "single_tbt_s": 0.0169, "systems": {
            CPP.name: _system(3.0), NO_CPP.name: _system(2.4), COLOCATED.name: _system(0.75)}},
            "130560": {"single_ttft_s": 30.2, "single_tbt_s": 0.0197, "systems": {
                CPP.name: _system(0.2, ">="), NO_CPP.name: _system(0.1), COLOCATED.name: _system(0.05)}}},
    }
    report = write_long_context_report(results, tmp_path / "out", "tsukimi-loadgen experiment long-context")
    text = report.read_text()
    assert "| 16,384 | 2.15 s / 16.9 ms | 3.000 | 2.400 | 0.750 | 4.00x | 3.20x | 1.25x |" in text
    assert "| 130,560 | 30.20 s / 19.7 ms | >= 0.200 | 0.100 | 0.050 | ~4.00x | 2.00x | ~2.00x |" in text
    assert (tmp_path / "out" / "capacity_by_length.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [
    (["long-context", "--lengths", "16k"], "whole numbers"),
    (["long-context", "--lengths", "100"], "lengths must be at least 512"),
    (["long-context", "--num-requests", "5"], "--num-requests at least 10"),
])
def test_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err
