"""The Conductor's cost models recover known coefficients from noisy step timings, never go negative, and do not
extrapolate a slope fitted on a narrow range."""

from __future__ import annotations

import random

import pytest

from services.scheduler.cost_model import DecodeCostModel, LinearCostModel, PrefillCostModel
from shared.wire.protocol import attention_work


def test_prefill_fit_recovers_a_known_model() -> None:
    rng = random.Random(0)
    model = PrefillCostModel()
    prior = model.predict(1000, 0)
    for _ in range(200):
        n = rng.randint(16, 2048)
        r = rng.randint(0, n)
        truth = 0.01 + (n - r) / 500 + attention_work(n, r) * 5e-8
        model.add_step(n - r, attention_work(n, r), truth * rng.uniform(0.9, 1.1))
    assert model.predict(1000, 0) == pytest.approx(0.01 + 2.0 + 0.025, rel=0.05)
    assert model.predict(1000, 0) != pytest.approx(prior, rel=0.05)
    assert model.predict(1000, 1000) == 0.0  # fully cached: nothing to compute
    assert model.predict(2000, 1000) < model.predict(2000, 0)


def test_decode_fit_and_nonnegative_coefficients() -> None:
    model = DecodeCostModel()
    for batch in range(1, 33):
        model.add_step(batch, 500.0 * batch, 0.03 + 0.002 * batch)  # no context term at all
    assert model.predict(16, 8000) == pytest.approx(0.062, rel=0.02)
    assert (model.model.coef >= 0).all()


def test_bad_samples_are_ignored_and_the_prior_holds_until_enough() -> None:
    model = LinearCostModel([1.0, 0.0, 0.0], min_samples=4)
    for sample in [(-1.0, 0.0, 1.0), (1.0, float("nan"), 1.0), (1.0, 1.0, 5.0)]:
        model.add(*sample)
    assert model.num_samples == 1 and model.predict(1.0, 1.0) == 1.0


def test_a_feature_that_never_varied_keeps_its_prior() -> None:
    """Only batch-1 steps seen: the batch coefficient cannot be fitted, so the prior's growth with batch stays."""
    model = DecodeCostModel()
    prior_slope = model.model.prior[1]
    for context in range(100, 3000, 100):
        model.add_step(1, context, 0.05 + 1e-5 * context)
    assert model.model.coef[1] == prior_slope > 0
    assert model.predict(1, 1000) == pytest.approx(0.06, rel=0.05)
    assert model.predict(8, 1000) > model.predict(1, 1000)


def test_a_slope_fitted_on_a_narrow_range_is_not_extrapolated() -> None:
    """A fresh decode instance has run a few short chats (contexts 33 to 44 tokens) on a busy machine: noise makes
    the context slope look steep; a 500-token prompt must not be predicted at many times the observed step."""
    rng = random.Random(0)
    model = DecodeCostModel()
    steps = [(33 + i % 12, 0.05 + 0.002 * (i % 12) + rng.uniform(0, 0.004)) for i in range(20)]  # 2 ms a token
    for context, seconds in steps:
        model.add_step(1, context, seconds)
    observed = model.predict(1, 44)
    assert model.model.coef[2] > 1e-3 and observed == pytest.approx(0.072, abs=0.006)  # a steep slope, fitted ...
    reach = 44 * 44 / 33  # ... trusted as far beyond the 33-44 range as it spans (x 4/3), the prior's slope beyond
    edge, prior_slope = model.predict(1, reach), model.model.prior[2]
    assert edge == pytest.approx(observed + (reach - 44) * model.model.coef[2])
    far = model.predict(1, 544)
    assert far == pytest.approx(edge + (544 - reach) * prior_slope) and far < 0.1  # not 1.1 s
    assert model.predict(1, 40) < observed  # inside the range the fit holds
    assert model.predict(1, 10) == pytest.approx(model.predict(1, 33 * 33 / 44) - (33 * 33 / 44 - 10) * prior_slope)
