"""FastGen's profiling on small synthetic attention: the cheapest policy that recovers T of the mass wins, the
threshold moves the choice, GQA serves the worst query head, T=1.0 means full unless a cheaper policy truly loses
nothing, heavy hitters are ranked only by earlier rows; and the prompt pass that feeds it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from shared.fastgen.policies import FastGenSettings
from shared.fastgen.profile import causal_row_probs, choose_policies, policy_counts, profile_layer
from shared.model.llama import DenseCausalAttention
from shared.tools.eval.fastgen_attention import PrefillAttention

N = 40
NO_CLASS = torch.zeros(N, dtype=torch.bool)
FIRST_SPECIAL = torch.zeros(N, dtype=torch.bool)
FIRST_SPECIAL[0] = True

PAPER = FastGenSettings(wider_local=(), frequent_alone=True)  # the FastGen paper's ladder
SPECIAL, PUNCT, FREQUENT, LOCAL, FULL = range(5)  # its policy ids

Row = Callable[[int], torch.Tensor]  # position i -> attention over the N keys (zero past i)


def rows(row: Row, num_rows: int = N) -> torch.Tensor:
    """[num_rows, N]: the last num_rows positions' attention."""
    return torch.stack([row(i) for i in range(N - num_rows, N)]).double()


def onto(weights: dict[int, float]) -> torch.Tensor:
    out = torch.zeros(N)
    for key, weight in weights.items():
        out[key] += weight
    return out


def sink(i: int) -> torch.Tensor:
    return onto({0: 0.97, i: 0.03})  # row 0: both on key 0, itself


def uniform(i: int) -> torch.Tensor:
    return onto({j: 1 / (i + 1) for j in range(i + 1)})


def previous(i: int) -> torch.Tensor:
    return onto({max(i - 1, 0): 1.0})


def latest_punct(i: int) -> torch.Tensor:
    punct = max((j for j in (0, 10, 20, 30) if j < i), default=i)
    return onto({punct: 0.97, i: 0.03})


def choose(
    row: Row, special: torch.Tensor = NO_CLASS, punct: torch.Tensor = NO_CLASS, ladder: FastGenSettings = PAPER,
    **settings: float,
) -> int:
    profile = profile_layer(rows(row)[None], (special, punct), 1, dataclasses.replace(ladder, **settings))
    return int(profile.policies[0])


def test_the_cheapest_policy_that_recovers_enough_is_chosen() -> None:
    punct = NO_CLASS.clone()
    punct[[0, 10, 20, 30]] = True
    assert choose(sink, special=FIRST_SPECIAL, punct=punct) == SPECIAL  # every policy would do
    assert choose(latest_punct, punct=punct) == PUNCT
    assert choose(sink) == FREQUENT  # key 0 is no special token, but every row before gave it attention
    assert choose(previous) == LOCAL
    assert choose(previous, r_local=0.0) == FULL
    assert choose(uniform) == FULL


def recent_half(i: int) -> torch.Tensor:
    return onto({j: 1 / (i - i // 2) for j in range(i // 2, i)}) if i > 1 else onto({i: 1.0})


def test_our_ladder_widens_the_window_before_keeping_everything() -> None:
    ours = FastGenSettings()
    assert choose(sink, ladder=ours) == 2  # no heavy hitters alone: the first rung with them has the 30% window
    assert choose(previous, ladder=ours) == 2
    assert choose(recent_half, ladder=ours) == 3  # the newest half: the 50% window
    assert choose(recent_half) == FULL  # the paper's ladder has no rung for it
    assert choose(uniform, ladder=ours) == 4  # the oldest 30% are the heavy hitters, the 70% window the rest
    assert choose(uniform, ladder=ours, r_frequent=0.1) == ours.full


def test_heavy_hitters_are_ranked_by_the_rows_before() -> None:
    """A previous-token head: key i-1 only draws attention from row i itself, so ranking by every row (own and later
    included) would keep it as a heavy hitter and wrongly pass `frequent`; decoding never sees that attention first."""
    profile = profile_layer(rows(previous)[None], (NO_CLASS, NO_CLASS), 1, PAPER)
    assert profile.lost[FREQUENT, 0] > 0.9


def mixed(i: int) -> torch.Tensor:
    return 0.9 * onto({0: 1.0}) + 0.1 * uniform(i)


def test_the_threshold_moves_the_choice_and_lost_mass_is_what_the_kept_keys_miss() -> None:
    # Under `special` row i keeps key 0 and itself: it loses the uniform part on the other i - 1 keys.
    expected = sum(0.1 * max(i - 1, 0) / (i + 1) for i in range(N)) / N
    profile = profile_layer(rows(mixed)[None], (FIRST_SPECIAL, NO_CLASS), 1, FastGenSettings())
    assert float(profile.lost[SPECIAL, 0]) == pytest.approx(expected)
    assert (profile.lost[:, 0].diff() <= 1e-12).all()  # each policy keeps more, so loses no more
    assert choose(mixed, special=FIRST_SPECIAL, threshold=1 - expected - 1e-6) == SPECIAL
    assert choose(mixed, special=FIRST_SPECIAL, threshold=1 - expected + 1e-6) != SPECIAL
    assert choose(mixed, special=FIRST_SPECIAL, threshold=0.999) == FULL


def test_a_kv_head_serves_its_worst_query_head() -> None:
    probs = torch.stack([rows(sink), rows(uniform), rows(sink), rows(sink)])  # KV head 0: heads 0, 1; 1: heads 2, 3
    profile = profile_layer(probs, (FIRST_SPECIAL, NO_CLASS), 2, PAPER)
    assert profile.policies.tolist() == [FULL, SPECIAL]
    alone = profile_layer(rows(uniform)[None], (FIRST_SPECIAL, NO_CLASS), 1, PAPER)
    torch.testing.assert_close(profile.lost[:, 0], alone.lost[:, 0])  # the max over the group, not the mean
    torch.testing.assert_close(profile.scores, torch.stack([probs[:2].sum(dim=(0, 1)), probs[2:].sum(dim=(0, 1))]))
    assert policy_counts(profile.policies, PAPER) == {
        "special": 1, "special+punct": 0, "special+punct+frequent": 0, "special+punct+frequent+local": 0, "full": 1
    }


def test_threshold_one_means_full_even_where_a_cheaper_policy_loses_nothing_on_the_prompt() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, N, N, generator=g) * 3
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    probs = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    punct = torch.rand(N, generator=g) < 0.3
    profile = profile_layer(probs, (FIRST_SPECIAL, punct), 3, FastGenSettings(threshold=1.0))
    assert (profile.policies == FastGenSettings().full).all()
    exact = profile_layer(rows(lambda i: onto({0: 1.0}))[None], (FIRST_SPECIAL, NO_CLASS), 1,
                          FastGenSettings(threshold=1.0))
    assert float(exact.lost[SPECIAL, 0]) == 0 and int(exact.policies[0]) == FastGenSettings().full
    cheap = profile_layer(rows(lambda i: onto({0: 1.0}))[None], (FIRST_SPECIAL, NO_CLASS), 1,
                          FastGenSettings(threshold=0.999))
    assert int(cheap.policies[0]) == SPECIAL


def test_profiling_the_last_rows_only() -> None:
    def late_sink(i: int) -> torch.Tensor:
        return sink(i) if i >= N - 8 else uniform(i)

    def profile(num_rows: int) -> int:
        result = profile_layer(rows(late_sink, num_rows)[None], (FIRST_SPECIAL, NO_CLASS), 1, PAPER)
        return int(result.policies[0])

    assert profile(8) == SPECIAL and profile(N) == FULL
    with pytest.raises(ValueError, match="does not fit"):
        profile_layer(torch.zeros(1, N + 1, N), (NO_CLASS, NO_CLASS), 1, FastGenSettings())
    with pytest.raises(ValueError, match="does not fit"):
        profile_layer(torch.zeros(3, N, N), (NO_CLASS, NO_CLASS), 2, FastGenSettings())


def test_choose_policies_takes_the_first_good_enough() -> None:
    lost = torch.tensor([[0.2, 0.04, 0.3], [0.1, 0.0, 0.3], [0.05, 0.0, 0.3], [0.01, 0.0, 0.06]], dtype=torch.float64)
    assert choose_policies(lost, 0.95).tolist() == [FREQUENT, SPECIAL, FULL]
    assert choose_policies(lost, 0.9999).tolist() == [FULL, PUNCT, FULL]
    assert choose_policies(lost, 1.0).tolist() == [FULL] * 3
    assert choose_policies(lost[:2], 0.95).tolist() == [2, SPECIAL, 2]  # the full cache: one past the rungs given


# ---- the prompt pass ------------------------------------------------------------------------------------------------


def test_causal_row_probs_are_the_softmax_of_the_visible_keys() -> None:
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(10, 4, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    probs = causal_row_probs(q[6:], k)  # rows 6..9
    assert probs.shape == (4, 4, 10) and probs.dtype == torch.float64
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(4, 4, dtype=torch.float64))
    assert (probs[:, 0, 7:] == 0).all() and (probs[:, 3] > 0).all()
    head, row = 3, 7  # query head 3 reads KV head 1
    expected = (q[row, head] @ k[: row + 1, 1].T / 8**0.5).softmax(dim=-1)
    torch.testing.assert_close(probs[head, row - 6, : row + 1].float(), expected)


@pytest.mark.parametrize("profile_rows, expected_rows", [(None, 10), (3, 3), (50, 10)])
def test_the_prompt_pass_is_causal_attention_and_shows_the_last_rows(
    profile_rows: int | None, expected_rows: int
) -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(10, 4, 8, generator=g), torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 8)
    seen: list[tuple[int, torch.Tensor]] = []
    prefill = PrefillAttention(profile_rows, lambda layer, probs: seen.append((layer, probs)))
    out = prefill.attend(5, q, k, v, k)
    torch.testing.assert_close(out, DenseCausalAttention().attend(5, q, k, v, k))
    assert [layer for layer, _ in seen] == [5] and seen[0][1].shape == (4, expected_rows, 10)
    torch.testing.assert_close(seen[0][1], causal_row_probs(q[10 - expected_rows :], k))
    assert torch.equal(prefill.keys[0], k) and torch.equal(prefill.values[0], v) and prefill.profile_s > 0
