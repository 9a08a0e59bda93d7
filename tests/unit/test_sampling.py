"""Sampling: parameter validation, top-k/top-p filtering, greedy rows, seeded generators."""

from __future__ import annotations

import pytest
import torch

from shared.engine.sampling import Sampler, _filter_top_k_top_p, draw_seed
from shared.wire.protocol import SamplingParams


@pytest.mark.parametrize(
    "settings", [dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                 dict(min_tokens=9, max_tokens=8), dict(stop=("",))],
)
def test_out_of_range_parameters_are_refused(settings: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**settings)  # type: ignore[arg-type]


def test_top_k_keeps_exactly_the_k_likeliest() -> None:
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5])
    kept = torch.isfinite(_filter_top_k_top_p(logits, top_k=3, top_p=1.0)).nonzero().flatten().tolist()
    assert kept == [1, 2, 4]


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert torch.isfinite(_filter_top_k_top_p(logits, 0, 0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(_filter_top_k_top_p(logits, 0, 0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(_filter_top_k_top_p(logits, 0, 0.81)).tolist() == [True, True, True, False]
    assert torch.isfinite(_filter_top_k_top_p(logits, 0, 0.01)).tolist() == [True, False, False, False]


def test_greedy_rows_take_the_argmax_and_sampled_rows_respect_filters() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [2.0, 2.0, 0.0, -9.0]])
    sampler = Sampler()
    greedy, top2 = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2)
    seen = {tuple(sampler.sample(logits, [greedy, top2], [0, i])) for i in range(40)}
    assert {first for first, _ in seen} == {1}
    assert {second for _, second in seen} == {0, 1}


def test_a_seed_fixes_the_sequence_of_draws() -> None:
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=42)
    draws = []
    for _ in range(2):
        sampler = Sampler()
        draws.append([sampler.sample(logits, [params], [i])[0] for i in range(10)])
    assert draws[0] == draws[1] and len(set(draws[0])) > 5


def test_a_seeded_draw_depends_on_its_position_alone() -> None:
    """What lets prefill draw the first token and decode the rest: a fresh sampler at position 3 draws what a sampler
    that drew positions 0-2 before (and other requests in between) draws there."""
    logits = torch.zeros(1, 1000)
    params, other = SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=8)
    busy = Sampler()
    history = []
    for i in range(6):
        history.append(busy.sample(logits, [params], [i])[0])
        busy.sample(logits, [other], [i])
    assert [Sampler().sample(logits, [params], [i])[0] for i in range(6)] == history
    assert len({draw_seed(7, i) for i in range(1000)} | {draw_seed(8, i) for i in range(1000)}) == 2000


def test_greedy_rows_take_the_first_of_tied_maxima() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0], [5.0, -1.0, 2.0, 5.0]])
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    assert Sampler().sample(logits, [greedy] * 3, [0, 0, 0]) == [1, 0, 0]
