"""The experiment's capacity arithmetic, worked by hand: where the share meeting the SLOs crosses 90%, its bounds when
the sweep never crosses, and the ratio of two capacities with those bounds carried over."""

from __future__ import annotations

import pytest

from loadgen.workload import PlannedRequest
from shared.tools.experiment.capacity import Capacity, capacity, capacity_ratio
from shared.tools.experiment.mooncake import ExperimentConfig, offered_rate, plan_runs


def test_capacity_interpolates_where_the_share_falls_to_the_threshold() -> None:
    # 1.0 at 1 req/s, 0.8 at 2 req/s: the share falls by 0.2 per req/s, so 0.9 is reached at 1.5 req/s
    assert capacity([(2.0, 0.8), (1.0, 1.0), (3.0, 0.1)]) == Capacity(pytest.approx(1.5))
    # the first load below the threshold decides, even if a later one recovers (noise): 0.95 -> 0.85 crosses at 2.5
    assert capacity([(1.0, 1.0), (2.0, 0.95), (3.0, 0.85), (4.0, 0.99)]).rate == pytest.approx(2.5)


def test_capacity_is_a_bound_when_the_sweep_never_crosses() -> None:
    assert capacity([(1.0, 1.0), (2.0, 0.9)]) == Capacity(2.0, ">=")  # exactly 90% still counts as served
    assert capacity([(1.0, 0.5), (2.0, 0.4)]) == Capacity(1.0, "<")
    with pytest.raises(ValueError):
        capacity([])


@pytest.mark.parametrize(
    ("ours", "baseline", "value", "bound"),
    [
        (Capacity(3.0), Capacity(1.5), 2.0, "="),
        (Capacity(3.0, ">="), Capacity(1.5), 2.0, ">="),  # ours could be higher
        (Capacity(3.0), Capacity(1.5, "<"), 2.0, ">="),  # the baseline could be lower
        (Capacity(3.0, ">="), Capacity(1.0, "<"), 3.0, ">="),
        (Capacity(1.0, "<"), Capacity(2.0), 0.5, "<="),
        (Capacity(1.0), Capacity(2.0, ">="), 0.5, "<="),
        (Capacity(2.0, ">="), Capacity(2.0, ">="), 1.0, "?"),  # both served everything: no comparison
        (Capacity(1.0, "<"), Capacity(1.0, "<"), 1.0, "?"),
    ],
)
def test_the_ratio_carries_the_bounds(ours: Capacity, baseline: Capacity, value: float, bound: str) -> None:
    ratio = capacity_ratio(ours, baseline)
    assert (ratio.value, ratio.bound) == (pytest.approx(value), bound)


def test_the_plan_shares_the_conductor_run_between_the_sweep_and_the_policies(tmp_path: object) -> None:
    config = ExperimentConfig(trace=tmp_path, log_dir=tmp_path, time_scales=(4.0, 2.0),  # type: ignore[arg-type]
                              policy_time_scale=2.0, policies=("random", "conductor", "least_loaded"))
    runs = [(r.system, r.policy, r.time_scale) for r in plan_runs(config)]
    assert runs == [("baseline", "least_loaded", 4.0), ("tsukimi", "conductor", 4.0),
                    ("baseline", "least_loaded", 2.0), ("tsukimi", "conductor", 2.0),
                    ("tsukimi", "random", 2.0), ("tsukimi", "least_loaded", 2.0)]


def test_the_offered_rate_is_the_count_over_the_span_of_arrivals() -> None:
    requests = [PlannedRequest(i, arrival, [1], 1) for i, arrival in enumerate([0.0, 1.0, 4.0, 5.0])]
    assert offered_rate(requests) == pytest.approx(4 / 5)


def test_the_sweep_uses_only_each_systems_own_policy(tmp_path: object) -> None:
    """tsukimi's sweep is the Conductor's runs, the baseline's its routing's; a policy run of tsukimi at the same
    load (least_loaded, say, which is also the baseline's routing) stays out of tsukimi's sweep."""
    from shared.tools.experiment.mooncake import RunOutcome
    from shared.tools.experiment.results import compute

    config = ExperimentConfig(trace=tmp_path, log_dir=tmp_path, time_scales=(2.0,), policy_time_scale=2.0,  # type: ignore[arg-type]
                              policies=("least_loaded", "conductor"))
    runs = [RunOutcome("baseline", "least_loaded", 2.0, 1.0), RunOutcome("tsukimi", "conductor", 2.0, 1.0),
            RunOutcome("tsukimi", "least_loaded", 2.0, 1.0)]
    results = compute(config, runs)
    assert [len(points) for points in results.shares["tsukimi"].values()] == [1, 1, 1]
    assert set(results.avg_ttft_s) == {"conductor", "least_loaded"}
