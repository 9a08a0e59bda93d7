"""Failure isolation's bookkeeping: a failed step's requests are tested in halves until one that fails alone is the
culprit; passing halves are cleared; requests that end meanwhile drop out; failing on and on means broken."""

from __future__ import annotations

from shared.engine.isolation import FailureIsolation


def _run(isolation: FailureIsolation, culprits: set[str], ids: list[str]) -> tuple[list[str], int]:
    """Drive steps as the engine does (a step fails when it runs a culprit) until an unrestricted step passes.
    Returns the requests failed alone, in order, and the number of steps."""
    live, failed_alone, num_steps = set(ids), [], 0
    while True:
        restriction = isolation.restriction(live)
        ran = [r for r in ids if r in live and (restriction is None or r in restriction)]
        num_steps += 1
        if not culprits & set(ran):
            isolation.passed(restriction, set(ran))
            if restriction is None:
                return failed_alone, num_steps
            continue
        culprit = isolation.failed(restriction, ran)
        if culprit is not None:
            failed_alone.append(culprit)
            live.discard(culprit)


def test_one_culprit_among_eight_is_found_in_log_steps_and_fails_alone() -> None:
    isolation = FailureIsolation()
    ids = [f"r{i}" for i in range(8)]
    failed, num_steps = _run(isolation, {"r5"}, ids)
    assert failed == ["r5"]
    assert num_steps <= 2 * 3 + 2  # bisection: about two steps per halving, not one per request
    assert isolation.restriction(set(ids) - {"r5"}) is None
    assert isolation.num_consecutive_failures == 0  # the last step passed


def test_two_culprits_are_both_found_and_nobody_else_fails() -> None:
    ids = [f"r{i}" for i in range(16)]
    failed, _ = _run(FailureIsolation(), {"r2", "r11"}, ids)
    assert sorted(failed) == ["r11", "r2"]


def test_a_group_is_tested_half_first_and_cleared_when_it_passes() -> None:
    isolation = FailureIsolation()
    assert isolation.failed(None, ["a", "b", "c", "d"]) is None
    first = isolation.restriction({"a", "b", "c", "d"})
    assert first == {"a", "b"}
    isolation.passed(first, {"a", "b"})
    assert isolation.restriction({"a", "b", "c", "d"}) == {"c", "d"}


def test_requests_that_ended_drop_out_of_their_group() -> None:
    isolation = FailureIsolation()
    isolation.failed(None, ["a", "b", "c", "d"])
    assert isolation.restriction({"c", "d"}) == {"c", "d"}  # a and b were cancelled: their group is gone
    assert isolation.restriction(set()) is None


def test_a_transient_fault_clears_every_suspect() -> None:
    isolation = FailureIsolation()
    isolation.failed(None, ["a", "b", "c"])
    while (group := isolation.restriction({"a", "b", "c"})) is not None:
        isolation.passed(group, set(group))
    assert isolation.num_consecutive_failures == 0


def test_failing_whatever_runs_makes_the_engine_broken() -> None:
    isolation = FailureIsolation(max_consecutive_failures=4)
    for _ in range(3):
        isolation.failed(None, ["a"])
        assert not isolation.is_broken
    isolation.failed(None, ["b"])
    assert isolation.is_broken
