"""Which keys a KV head keeps: FastGen's policies as masks, and the rules that apply them (and the baselines'
StreamingLLM and H2O rules) after every step of a generation.

Owns the definitions of the local window, the heavy hitters and the policy unions, shared by profiling (many query
rows at once) and decoding (one row per step). Which policy a head gets is `profile`'s; the attention is `attention`'s.

Masks are bool over key positions; `scores` are each key's accumulated attention (summed over the query heads of the
KV head), higher first. A rule's `keep` runs after a step's attention: from the keys that step saw, it returns those
the next step will see besides its own new key (which every step sees).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from shared.fastgen.policies import FastGenSettings

NUM_SINKS = 4  # StreamingLLM's attention sinks: the sequence's first tokens


def ratio_budget(ratio: float, lengths: torch.Tensor) -> torch.Tensor:
    """ceil(ratio x length) keys for each length, long [R]; the epsilon keeps 0.3 x 10 at 3, not 4."""
    return torch.ceil(lengths.double() * ratio - 1e-9).clamp(min=0).long()


def newest(lengths: torch.Tensor, counts: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The last counts[r] of the first lengths[r] positions, bool [R, num_keys]."""
    position = torch.arange(num_keys)
    return (position >= (lengths - counts)[:, None]) & (position < lengths[:, None])


def top_scored(scores: torch.Tensor, visible: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The counts[r] visible keys of row r with the highest scores (ties: the earlier key), or all if fewer.

    Args:
        scores: [kv_heads, R, n], each row's ranking; visible: bool [kv_heads, R, n]; counts: long [R].
    Returns:
        bool [kv_heads, R, n], a subset of `visible`.
    """
    ranked = scores.expand(visible.shape).masked_fill(~visible, -math.inf)
    order = ranked.argsort(dim=-1, descending=True, stable=True)  # visible keys first, best first
    in_budget = torch.arange(visible.shape[-1], device=visible.device) < counts.to(visible.device)[:, None]
    chosen = in_budget & visible.gather(-1, order)
    return torch.zeros_like(visible).scatter(-1, order, chosen)


def policy_masks(
    visible: torch.Tensor, classes: tuple[torch.Tensor, torch.Tensor], scores: torch.Tensor, lengths: torch.Tensor,
    settings: FastGenSettings,
) -> torch.Tensor:
    """What each cheap policy keeps of the visible keys, for rows whose sequence is lengths[r] tokens long.

    Args:
        visible: bool [kv_heads, R, n], the keys row r may keep (none at or past lengths[r]).
        classes: (special, punct), bool [n] each: the keys' token classes.
        scores: [kv_heads, R, n], accumulated attention as row r ranks the heavy hitters.
        lengths: long [R]; the budgets are ceil(r_f x length) heavy hitters and the ceil(r_l x length) newest.
    Returns:
        bool [len(CHEAP_POLICIES), kv_heads, R, n], indexed by `Policy`, each a superset of the one before.
    """
    special, punct = classes
    num_keys = visible.shape[-1]
    kept_special = visible & special
    kept_punct = kept_special | (visible & punct)
    heavy = top_scored(scores, visible, ratio_budget(settings.r_frequent, lengths))
    kept_frequent = kept_punct | heavy
    local = newest(lengths, ratio_budget(settings.r_local, lengths), num_keys)
    kept_local = kept_frequent | (visible & local)
    return torch.stack([kept_special, kept_punct, kept_frequent, kept_local])


def kept_entries(
    policies: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, classes: tuple[torch.Tensor, torch.Tensor],
    scores: torch.Tensor, lengths: torch.Tensor | int, settings: FastGenSettings,
) -> torch.Tensor:
    """What each lane keeps of its entries after a step over its sequence's `lengths` tokens: `policy_masks`' rules
    for keys stored in any order (the engine's lanes), each entry knowing its position and class.

    Args:
        policies: long [R], each lane's `Policy`; positions: long [R, E]; valid: bool [R, E], the entries held.
        classes: (special, punct), bool [R, E] each; scores: [R, E], accumulated attention.
        lengths: long [R], or one length for every lane.
    Returns:
        bool [R, E], within `valid`: FULL keeps every valid entry.
    """
    special, punct = classes
    lengths = torch.as_tensor(lengths).expand(valid.shape[0]).cpu()
    kept_special = valid & special
    kept_punct = kept_special | (valid & punct)
    heavy = top_scored(scores[None], valid[None], ratio_budget(settings.r_frequent, lengths))[0]
    kept_frequent = kept_punct | heavy
    oldest_local = (lengths - ratio_budget(settings.r_local, lengths)).to(valid.device)
    kept_local = kept_frequent | (valid & (positions >= oldest_local[:, None]))
    options = torch.stack([kept_special, kept_punct, kept_frequent, kept_local, valid])  # indexed by Policy
    return options[policies, torch.arange(valid.shape[0], device=valid.device)]


class KeptRule(Protocol):
    """After a step over a sequence `length` tokens long, which of the keys it saw stay."""

    def keep(self, visible: torch.Tensor, scores: torch.Tensor, length: int) -> torch.Tensor:
        """visible: bool [kv_heads, length]; scores: [kv_heads, length]. Returns bool [kv_heads, length] within
        `visible`."""
        ...


class KeepAll:
    """The full cache."""

    def keep(self, visible: torch.Tensor, scores: torch.Tensor, length: int) -> torch.Tensor:
        return visible.clone()


class FastGenRule:
    """Each KV head keeps what its policy keeps, for the whole generation.

    Args:
        policies: long [kv_heads], `Policy` values.
        classes: (special, punct), bool [num_tokens] each, for every token the sequence will hold.
        settings: r_l and r_f.
    """

    def __init__(
        self, policies: torch.Tensor, classes: tuple[torch.Tensor, torch.Tensor], settings: FastGenSettings
    ) -> None:
        self.policies, self.classes, self.settings = policies, classes, settings

    def keep(self, visible: torch.Tensor, scores: torch.Tensor, length: int) -> torch.Tensor:
        classes = (self.classes[0][:length], self.classes[1][:length])
        one_row = torch.tensor([length])
        masks = policy_masks(visible[:, None], classes, scores[:, None], one_row, self.settings)[:, :, 0]
        options = torch.cat([masks, visible[None]])  # [len(Policy), kv_heads, length]; FULL keeps all it saw
        return options[self.policies, torch.arange(visible.shape[0])]


def equal_memory_budget(fraction: float, length: int) -> int:
    """Keys a head sees at a step over `length` tokens when it may hold `fraction` of them: round(fraction x
    length), at least the step's own key."""
    return min(length, max(1, round(fraction * length)))


class SinkWindowRule:
    """StreamingLLM: the first `NUM_SINKS` tokens plus the newest, `fraction` of the length in all, every head alike."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def keep(self, visible: torch.Tensor, scores: torch.Tensor, length: int) -> torch.Tensor:
        count = equal_memory_budget(self.fraction, length + 1) - 1  # the next step adds its own key
        sinks = min(NUM_SINKS, count)
        position = torch.arange(length)
        return visible & ((position < sinks) | (position >= length - (count - sinks)))


class HeavyHitterRule:
    """H2O: half the budget for the newest tokens, half for the highest accumulated attention, `fraction` of the
    length in all, every head alike."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def keep(self, visible: torch.Tensor, scores: torch.Tensor, length: int) -> torch.Tensor:
        count = equal_memory_budget(self.fraction, length + 1) - 1  # the next step adds its own key
        num_heavy = count // 2
        lengths = torch.tensor([length])
        recent = newest(lengths, torch.tensor([count - num_heavy]), length)[0] & visible  # [kv_heads, length]
        heavy = top_scored(scores[:, None], (visible & ~recent)[:, None], torch.tensor([num_heavy]))[:, 0]
        return recent | heavy
