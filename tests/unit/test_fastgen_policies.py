"""FastGen's policies and what they keep: the order and names, the settings' validation (and their TSUKIMI_*
variables), the token classes, the policy masks, the decode rules (FastGen's, StreamingLLM's, H2O's), and decoding
with them: the local window slides, heavy hitters follow the accumulated attention, evicted keys never come back, each
head sees only what it kept."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from shared.fastgen.kept import (
    FastGenRule,
    HeavyHitterRule,
    KeepAll,
    KeptRule,
    SinkWindowRule,
    equal_memory_budget,
    policy_masks,
    ratio_budget,
    top_scored,
)
from shared.fastgen.policies import FastGenSettings, Rung, parse_shares
from shared.fastgen.token_classes import TokenClasses, is_punctuation
from shared.tools.eval.fastgen_attention import DecodeAttention, PrefillAttention

PAPER = FastGenSettings(wider_local=(), frequent_alone=True)  # the FastGen paper's ladder
SPECIAL_ONLY, WITH_PUNCT, FREQUENT, LOCAL, FULL = range(5)  # its policy ids

# ---- policies, settings, token classes ------------------------------------------------------------------------------


def test_the_papers_ladder_runs_cheapest_first_as_cumulative_unions() -> None:
    assert PAPER.labels() == [
        "special", "special+punct", "special+punct+frequent", "special+punct+frequent+local", "full"
    ]
    assert PAPER.ladder == (Rung(), Rung(True), Rung(True, 0.3), Rung(True, 0.3, 0.3)) and PAPER.full == FULL


def test_our_ladder_widens_the_window_and_never_keeps_heavy_hitters_alone() -> None:
    ours = FastGenSettings()
    assert ours.labels() == [
        "special", "special+punct", "special+punct+frequent+local@0.3", "special+punct+frequent+local@0.5",
        "special+punct+frequent+local@0.7", "full",
    ]
    assert ours.full == 5 and ours.ladder[2:] == tuple(Rung(True, 0.3, w) for w in (0.3, 0.5, 0.7))
    both = FastGenSettings(r_local=0.2, r_frequent=0.1, wider_local=(0.4,), frequent_alone=True)
    assert both.ladder[2:] == (Rung(True, 0.1), Rung(True, 0.1, 0.2), Rung(True, 0.1, 0.4))


def test_shares_parse_from_text() -> None:
    assert parse_shares("0.5,0.7") == (0.5, 0.7) and parse_shares(" none ") == () and parse_shares("") == ()
    with pytest.raises(ValueError, match="shares like"):
        parse_shares("0.5;0.7")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"threshold": 0.0}, "threshold"), ({"threshold": 1.01}, "threshold"), ({"r_local": -0.1}, "r_local"),
        ({"r_frequent": 1.5}, "r_frequent"), ({"profile_rows": 0}, "profile_rows"),
        ({"wider_local": (0.3,)}, "wider_local"), ({"wider_local": (0.7, 0.5)}, "wider_local"),
        ({"wider_local": (0.5, 1.2)}, "wider_local"), ({"r_local": 0.6}, "above r_local=0.6"),
    ],
)
def test_settings_out_of_range_raise(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FastGenSettings(**kwargs)


def test_settings_defaults_and_bounds_are_accepted() -> None:
    assert FastGenSettings() == FastGenSettings(0.95, 0.3, 0.3, None, (0.5, 0.7), False)
    FastGenSettings(threshold=1.0, r_local=0.0, r_frequent=1.0, profile_rows=1, wider_local=(0.9, 1.0))
    FastGenSettings(r_local=1.0, wider_local=())


@pytest.mark.parametrize(
    "text, expected",
    [(".", True), (",\n", True), ("  ", True), ("\n\n", True), ("--", True), ("”", True), ("...)", True),
     ("", False), ("a.", False), ("1", False), ("é", False), (" the", False)],
)
def test_punctuation_is_punctuation_and_whitespace_only(text: str, expected: bool) -> None:
    assert is_punctuation(text) is expected


class FakeTokenizer:
    """Byte-level pieces by id; id 0 and 5 are control tokens."""

    pieces = [b"<|end|>", b".", b" the", b"\xe2", b"\n", b"<|>"]
    control_token_ids = frozenset({0, 5})
    is_byte_level = True
    vocab_size = len(pieces)

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]


def test_token_classes_come_from_the_tokenizer() -> None:
    classes = TokenClasses.from_tokenizer(FakeTokenizer(), vocab_size=8)  # type: ignore[arg-type]
    assert classes.special.tolist() == [True, False, False, False, False, True, False, False]
    # "<|>" is made of punctuation but is special; b"\xe2" alone is not UTF-8; ids past the tokenizer are neither.
    assert classes.punct.tolist() == [False, True, False, False, True, False, False, False]
    special, punct = classes.of(torch.tensor([4, 0, 2, 1]))
    assert special.tolist() == [False, True, False, False] and punct.tolist() == [True, False, False, True]


@pytest.mark.slow
def test_token_classes_of_the_real_tokenizer(checkpoint) -> None:  # type: ignore[no-untyped-def]
    tokenizer = checkpoint.tokenizer
    classes = TokenClasses.from_tokenizer(tokenizer, checkpoint.config.vocab_size)
    assert not (classes.special & classes.punct).any()
    assert classes.special.nonzero().flatten().tolist() == sorted(tokenizer.control_token_ids)
    assert all(classes.punct[tokenizer.encode(text)].all() for text in (".", ",", "\n", ").", " \""))
    assert not classes.punct[tokenizer.encode(" the cat")].any()
    assert 100 < int(classes.punct.sum()) < 5000


# ---- masks ----------------------------------------------------------------------------------------------------------


def test_ratio_budgets_round_up_without_float_noise() -> None:
    assert ratio_budget(0.3, torch.tensor([10, 11, 1, 0])).tolist() == [3, 4, 1, 0]
    assert ratio_budget(0.0, torch.tensor([10])).tolist() == [0]
    assert ratio_budget(1.0, torch.tensor([7])).tolist() == [7]


def test_top_scored_takes_the_best_visible_keys_per_row() -> None:
    scores = torch.tensor([[5.0, 1.0, 4.0, 3.0, 2.0]])[:, None]  # [kv=1, 1, 5], shared by both rows
    visible = torch.tensor([[[True, True, True, True, True], [False, True, False, True, True]]])
    kept = top_scored(scores, visible, torch.tensor([2, 2]))
    assert kept[0].tolist() == [[True, False, True, False, False], [False, False, False, True, True]]
    assert top_scored(scores, visible, torch.tensor([9, 0]))[0].tolist() == [[True] * 5, [False] * 5]


SPECIAL = torch.tensor([True] + [False] * 9)
PUNCT = torch.zeros(10, dtype=torch.bool)
PUNCT[[4, 7]] = True
SCORES = torch.tensor([0.0, 9.0, 1.0, 8.0, 0.0, 0.0, 7.0, 0.0, 0.0, 0.0])  # heavy hitters: 1, 3, 6


def test_policy_masks_keep_the_classes_the_heavy_hitters_and_the_window() -> None:
    visible = torch.ones(1, 1, 10, dtype=torch.bool)
    masks = policy_masks(visible, (SPECIAL, PUNCT), SCORES[None, None], torch.tensor([10]), PAPER)
    kept = [set(mask[0, 0].nonzero().flatten().tolist()) for mask in masks]
    assert kept == [{0}, {0, 4, 7}, {0, 4, 7, 1, 3, 6}, {0, 4, 7, 1, 3, 6, 8, 9}]  # ceil(0.3 x 10) = 3 each
    masks = policy_masks(visible, (SPECIAL, PUNCT), SCORES[None, None], torch.tensor([10]), FastGenSettings())
    kept = [set(mask[0, 0].nonzero().flatten().tolist()) for mask in masks]
    assert kept == [{0}, {0, 4, 7}, {0, 4, 7, 1, 3, 6, 8, 9}, {0, 4, 7, 1, 3, 6, 5, 8, 9}, set(range(10)) - {2}]


def test_policy_masks_stay_within_what_is_visible() -> None:
    visible = torch.zeros(1, 1, 10, dtype=torch.bool)
    visible[0, 0, 5:] = True
    masks = policy_masks(visible, (SPECIAL, PUNCT), SCORES[None, None], torch.tensor([10]), FastGenSettings())
    assert set(masks[-1][0, 0].nonzero().flatten().tolist()) == {6, 7, 5, 8, 9}  # no 0, 1, 3, 4
    assert not (masks & ~visible).any()


def test_each_head_keeps_what_its_policy_keeps() -> None:
    policies = torch.tensor([SPECIAL_ONLY, FREQUENT, FULL])
    rule = FastGenRule(policies, (SPECIAL, PUNCT), PAPER)
    visible = torch.ones(3, 10, dtype=torch.bool)
    visible[2, 2] = False  # FULL keeps what it saw, nothing more
    kept = rule.keep(visible, SCORES.expand(3, 10), 10)
    assert [set(row.nonzero().flatten().tolist()) for row in kept] == [
        {0}, {0, 4, 7, 1, 3, 6}, set(range(10)) - {2}
    ]


# ---- decoding -------------------------------------------------------------------------------------------------------


def test_the_local_window_slides_and_evicted_keys_stay_evicted() -> None:
    rule = FastGenRule(torch.tensor([LOCAL]), (torch.zeros(30, dtype=torch.bool),) * 2,
                       FastGenSettings(r_local=0.3, r_frequent=0.0, wider_local=(), frequent_alone=True))
    kept = rule.keep(torch.ones(1, 20, dtype=torch.bool), torch.zeros(1, 20), 20)
    assert kept[0].nonzero().flatten().tolist() == [14, 15, 16, 17, 18, 19]  # ceil(0.3 x 20)
    for length in range(21, 30):
        visible = torch.zeros(1, length, dtype=torch.bool)
        visible[:, : length - 1] = kept
        visible[:, length - 1] = True  # the step's own key
        kept = rule.keep(visible, torch.zeros(1, length), length)
        budget = math.ceil(0.3 * length - 1e-9)
        assert kept[0].nonzero().flatten().tolist() == list(range(length - budget, length))


def test_heavy_hitters_follow_the_scores_among_the_keys_still_held() -> None:
    rule = FastGenRule(torch.tensor([FREQUENT]), (torch.zeros(12, dtype=torch.bool),) * 2,
                       FastGenSettings(r_frequent=0.2, wider_local=(), frequent_alone=True))
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    kept = rule.keep(torch.ones(1, 10, dtype=torch.bool), scores, 10)
    assert kept[0].nonzero().flatten().tolist() == [0, 1]  # ceil(0.2 x 10) = 2
    # A step: the new key 10 draws attention, key 1 gains some; the budget grows to ceil(0.2 x 11) = 3.
    scores = torch.cat([scores, torch.tensor([[9.0]])], dim=1)
    scores[0, 1] += 2.0
    visible = torch.cat([kept, torch.ones(1, 1, dtype=torch.bool)], dim=1)
    kept = rule.keep(visible, scores, 11)
    assert kept[0].nonzero().flatten().tolist() == [0, 1, 10]
    # Another: key 11 draws the most; key 2 would now rank first but was evicted; key 1 now outranks key 0.
    scores = torch.cat([scores, torch.tensor([[9.5]])], dim=1)
    scores[0, 2] = 100.0
    visible = torch.cat([kept, torch.ones(1, 1, dtype=torch.bool)], dim=1)
    kept = rule.keep(visible, scores, 12)  # ceil(0.2 x 12) = 3 of {0, 1, 10, 11}
    assert kept[0].nonzero().flatten().tolist() == [1, 10, 11]


def test_baselines_hold_their_budget_sinks_recent_and_heavy_hitters() -> None:
    length, fraction = 20, 0.5
    count = equal_memory_budget(fraction, length + 1) - 1
    scores = torch.arange(length, 0, -1).double()[None]  # the earliest keys score highest
    sinks = SinkWindowRule(fraction).keep(torch.ones(1, length, dtype=torch.bool), scores, length)
    assert sinks[0].nonzero().flatten().tolist() == [0, 1, 2, 3, *range(length - (count - 4), length)]
    h2o = HeavyHitterRule(fraction).keep(torch.ones(1, length, dtype=torch.bool), scores, length)
    num_heavy = count // 2
    assert h2o[0].nonzero().flatten().tolist() == [*range(num_heavy), *range(length - (count - num_heavy), length)]
    assert equal_memory_budget(0.0, 50) == 1 and equal_memory_budget(1.0, 50) == 50


def decode_setup(rules: list[list[KeptRule]], seed: int = 0) -> tuple[DecodeAttention, torch.Tensor, torch.Tensor]:
    """A one-layer prompt of 8 tokens (2 query heads, 1 KV head, head dim 4) decoded by `rules` variants."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(8, heads, 4, generator=g) for heads in (2, 1, 1))
    prefill = PrefillAttention(None, lambda layer, probs: None)
    prefill.attend(0, q, k, v, k)
    scores = torch.arange(8, 0, -1).double()[None]
    return DecodeAttention(prefill, [scores], rules, 12), k, v


def test_decoding_with_the_full_cache_is_plain_attention_and_accumulates_it() -> None:
    ctx, k, v = decode_setup([[KeepAll()]])
    g = torch.Generator().manual_seed(1)
    q_new, k_new, v_new = torch.randn(1, 2, 4, generator=g), torch.randn(1, 1, 4, generator=g), torch.randn(1, 1, 4)
    assert ctx.start_step() == 8
    out = ctx.attend(0, q_new, k_new, v_new, k_new)
    keys, values = torch.cat([k, k_new]), torch.cat([v, v_new])  # [9, 1, 4]
    probs = (q_new[0] @ keys[:, 0].T / 2).softmax(dim=-1)  # [2 heads, 9]
    torch.testing.assert_close(out[0], probs @ values[:, 0])
    expected = torch.cat([torch.arange(8, 0, -1).double(), torch.zeros(1)]) + probs.sum(dim=0).double()
    torch.testing.assert_close(ctx.scores[0][0, 0, :9], expected)
    assert ctx.visible_counts[0, 0].tolist() == [9]
    reference = F.scaled_dot_product_attention(q_new.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                               enable_gqa=True)
    torch.testing.assert_close(out, reference.transpose(0, 1))


def test_each_variant_sees_only_what_its_rule_kept() -> None:
    nothing = FastGenRule(torch.tensor([SPECIAL_ONLY]), (torch.zeros(12, dtype=torch.bool),) * 2, FastGenSettings())
    ctx, _, _ = decode_setup([[KeepAll()], [nothing]])
    assert ctx.kept[0][1].sum() == 0 and ctx.kept[0][0, 0, :8].all()
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        ctx.start_step()
        q_new, k_new, v_new = (torch.randn(2, heads, 4, generator=g) for heads in (2, 1, 1))
        out = ctx.attend(0, q_new, k_new, v_new, k_new)
        torch.testing.assert_close(out[1], v_new[1].expand(2, 4))  # only its own key: its own value
        assert ctx.visible_counts[:, 0, 0].tolist() == [9 + step, 1]


def test_the_settings_read_fastgen_from_the_environment() -> None:
    from shared.config import ConfigError, load_settings

    env = {"TSUKIMI_KV_POLICY": "fastgen", "TSUKIMI_FASTGEN_T": "0.9", "TSUKIMI_FASTGEN_PROFILE_ROWS": "64"}
    engine = load_settings("decode", env).engine
    assert engine.kv_policy == "fastgen" and engine.fastgen.threshold == 0.9 and engine.fastgen.profile_rows == 64
    assert engine.fastgen.wider_local == (0.5, 0.7) and not engine.fastgen.frequent_alone
    paper = load_settings("decode", {**env, "TSUKIMI_FASTGEN_WIDER_LOCAL": "none",
                                     "TSUKIMI_FASTGEN_FREQUENT_ALONE": "on"}).engine.fastgen
    assert paper.labels() == PAPER.labels()
    with pytest.raises(ConfigError, match="wider_local must increase"):
        load_settings("decode", {**env, "TSUKIMI_FASTGEN_WIDER_LOCAL": "0.7,0.5"})
    with pytest.raises(ConfigError, match="shares like"):
        load_settings("decode", {**env, "TSUKIMI_FASTGEN_WIDER_LOCAL": "wide"})
    assert load_settings("decode", {}).engine.kv_policy == "full"
    with pytest.raises(ConfigError, match="threshold T must be in"):
        load_settings("decode", {**env, "TSUKIMI_FASTGEN_T": "1.5"})
    with pytest.raises(ConfigError, match="unknown KV policy"):
        load_settings("decode", {"TSUKIMI_KV_POLICY": "h2o"})
    assert load_settings("decode", {**env, "TSUKIMI_KV_CODEC": "kvquant-4"}).engine.kv_codec == "kvquant-4"
    with pytest.raises(ConfigError, match="raw pool or a kvquant codec, not kivi-4"):
        load_settings("decode", {**env, "TSUKIMI_KV_CODEC": "kivi-4"})
    with pytest.raises(ConfigError, match="applies to the real engine"):
        load_settings("decode", {**env, "TSUKIMI_ENGINE": "sim"})
