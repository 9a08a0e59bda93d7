"""Synthetic workloads: Poisson/Gamma arrivals, length ranges, shared-prefix groups, reproducibility."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from loadgen.workload import SyntheticSpec, arrival_offsets, as_text, sample_lengths, synthetic_requests


def _gaps(rate: float, burstiness: float, seed: int = 0, num: int = 20000) -> np.ndarray:
    return np.diff(arrival_offsets(num, rate, burstiness, np.random.default_rng(seed)))


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_the_mean_rate_holds_whatever_the_burstiness(burstiness: float) -> None:
    gaps = _gaps(rate=5.0, burstiness=burstiness)
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.05)


def test_burstiness_sets_how_uneven_the_gaps_are() -> None:
    # Gamma gaps have a coefficient of variation of 1/sqrt(shape): 1 for Poisson, 2 at burstiness 0.25.
    cv = {b: (g := _gaps(5.0, b)).std() / g.mean() for b in (0.25, 1.0, 4.0)}
    assert cv[1.0] == pytest.approx(1.0, rel=0.05)
    assert cv[0.25] == pytest.approx(2.0, rel=0.1)
    assert cv[4.0] == pytest.approx(0.5, rel=0.05)


def test_arrivals_start_at_zero_and_rise() -> None:
    offsets = arrival_offsets(100, 3.0, 1.0, np.random.default_rng(1))
    assert offsets[0] == 0.0 and len(offsets) == 100
    assert all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
    assert arrival_offsets(5, math.inf, 1.0, np.random.default_rng(1)) == [0.0] * 5
    assert arrival_offsets(0, 3.0, 1.0, np.random.default_rng(1)) == []


def test_lengths_stay_in_the_range() -> None:
    lengths = sample_lengths(100, 0.5, 5000, np.random.default_rng(0))
    assert min(lengths) == 50 and max(lengths) == 150
    assert sample_lengths(100, 0.0, 10, np.random.default_rng(0)) == [100] * 10
    assert min(sample_lengths(1, 0.9, 100, np.random.default_rng(0))) >= 1


def test_the_same_spec_gives_the_same_requests() -> None:
    spec = SyntheticSpec(num_requests=20, rate=4.0, burstiness=0.5, input_len=32, output_len=8, range_ratio=0.5)
    assert synthetic_requests(spec) == synthetic_requests(spec)
    assert synthetic_requests(spec) != synthetic_requests(replace(spec, seed=1))


def test_the_rate_changes_arrivals_only() -> None:
    spec = SyntheticSpec(num_requests=20, rate=4.0, input_len=32, output_len=8, range_ratio=0.5)
    slow, fast = synthetic_requests(spec), synthetic_requests(replace(spec, rate=8.0))
    assert [(r.prompt, r.output_len) for r in slow] == [(r.prompt, r.output_len) for r in fast]
    assert slow[-1].arrival_s == pytest.approx(2 * fast[-1].arrival_s)


def test_requests_have_the_drawn_lengths_and_token_range() -> None:
    spec = SyntheticSpec(num_requests=50, input_len=40, output_len=10, range_ratio=0.5, min_token_id=5, vocab_size=9)
    requests = synthetic_requests(spec)
    assert all(20 <= len(r.prompt) <= 60 and 5 <= r.output_len <= 15 for r in requests)
    assert len({len(r.prompt) for r in requests}) > 1
    assert {t for r in requests for t in r.prompt} == {5, 6, 7, 8}


def test_shared_prefix_groups() -> None:
    spec = SyntheticSpec(num_requests=9, input_len=16, output_len=4, shared_prefix_len=32, num_prefix_groups=3)
    requests = synthetic_requests(spec)
    prefixes = [tuple(r.prompt[:32]) for r in requests]
    assert all(len(r.prompt) == 48 and r.num_shared_prefix_tokens == 32 for r in requests)
    assert len(set(prefixes)) == 3
    assert all(prefixes[i] == prefixes[i % 3] for i in range(9))
    assert len({tuple(r.prompt[32:]) for r in requests}) == 9  # suffixes differ


def test_text_prompts_keep_equal_tokens_equal() -> None:
    spec = SyntheticSpec(num_requests=4, input_len=16, output_len=4, shared_prefix_len=8, num_prefix_groups=2)
    texts = [r.prompt for r in as_text(synthetic_requests(spec))]
    assert all(isinstance(t, str) and len(t.split()) == 24 for t in texts)
    assert texts[0].split()[:8] == texts[2].split()[:8]
    assert texts[0] != texts[2]


def test_a_bad_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="range ratio"):
        SyntheticSpec(range_ratio=1.0)
    with pytest.raises(ValueError, match="rate"):
        SyntheticSpec(rate=0.0)
