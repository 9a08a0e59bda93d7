"""A decode instance's view of a request's token gaps: Mooncake's TBT over them, the same definition loadgen measures
at the client, and nothing kept for a request once it is done."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadgen.metrics import tbt_s
from services.decode.token_gaps import TokenGaps, slowest_tenth_mean


@given(st.lists(st.floats(min_value=0.0, max_value=10.0), max_size=60))
def test_the_tbt_at_decode_is_the_clients_definition(gaps: list[float]) -> None:
    assert slowest_tenth_mean(gaps) == pytest.approx(tbt_s(gaps), abs=1e-12)


def test_a_requests_gaps_are_between_its_own_events() -> None:
    now = [0.0]
    gaps = TokenGaps(clock=lambda: now[0])
    for t, request_id in [(0.0, "a"), (0.5, "b"), (1.0, "a"), (1.2, "b"), (3.0, "a")]:
        now[0] = t
        gaps.made(request_id)
    gaps.made("a", at=3.1)  # the engine's time, not the clock's
    assert gaps.finish("a") == pytest.approx(2.0)  # gaps 1.0, 2.0, 0.1: the slowest one of three
    assert gaps.finish("b") == pytest.approx(0.7)
    assert len(gaps) == 0


def test_one_event_has_no_tbt_and_forgotten_requests_leave_nothing() -> None:
    gaps = TokenGaps(clock=lambda: 1.0)
    gaps.made("only")
    assert gaps.finish("only") is None
    gaps.made("failed")
    gaps.made("failed")
    gaps.forget("failed")
    assert len(gaps) == 0 and gaps.finish("failed") is None
