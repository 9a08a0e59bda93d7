"""Which keys a KV head keeps: FastGen's policies as masks, and the rules that apply them (and the baselines'
StreamingLLM and H2O rules) after every step of a generation.

Owns the definitions of the local window, the heavy hitters and the policy unions, shared by profiling (many query
rows at once) and decoding (one row per step). Which policy a head gets is `profile`'s; the attention is the harness's
(`shared.tools.eval.fastgen_attention`) or the engine's.

Masks are bool over key positions; `scores` are each key's accumulated attention (summed over the query heads of the
KV head), higher first. A rule's `keep` runs after a step's attention: from the keys that step saw, it returns those
the next step will see besides its own new key (which every step sees).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


def ladder_masks(
    settings: FastGenSettings, kept_special: torch.Tensor, kept_punct: torch.Tensor,
    heavy: Callable[[float], torch.Tensor], local: Callable[[float], torch.Tensor],
) -> list[torch.Tensor]:
    """Each rung's kept mask from its parts: the special and punctuation masks, `heavy(r_f)` and `local(r_l)` (each
    called once per distinct share), indexed by policy id."""
    heavy_of = {r: heavy(r) for r in {rung.r_frequent for rung in settings.ladder if rung.r_frequent > 0}}
    local_of = {r: local(r) for r in {rung.r_local for rung in settings.ladder if rung.r_local > 0}}
    masks = []
    for rung in settings.ladder:
        kept = kept_punct if rung.punct else kept_special
        if rung.r_frequent > 0:
            kept = kept | heavy_of[rung.r_frequent]
        if rung.r_local > 0:
            kept = kept | local_of[rung.r_local]
        masks.append(kept)
    return masks


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
        bool [len(settings.ladder), kv_heads, R, n], indexed by policy id, each a superset of the one before.
    """
    special, punct = classes
    num_keys = visible.shape[-1]
    kept_special = visible & special
    masks = ladder_masks(
        settings, kept_special, kept_special | (visible & punct),
        lambda r_frequent: top_scored(scores, visible, ratio_budget(r_frequent, lengths)),
        lambda r_local: visible & newest(lengths, ratio_budget(r_local, lengths), num_keys),
    )
    return torch.stack(masks)


def kept_entries(
    policies: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, classes: tuple[torch.Tensor, torch.Tensor],
    scores: torch.Tensor, lengths: torch.Tensor | int, settings: FastGenSettings,
) -> torch.Tensor:
    """What each lane keeps of its entries after a step over its sequence's `lengths` tokens: `policy_masks`' rules
    for keys stored in any order (the engine's lanes), each entry knowing its position and class.

    Args:
        policies: long [R], each lane's policy id; positions: long [R, E]; valid: bool [R, E], the entries held.
        classes: (special, punct), bool [R, E] each; scores: [R, E], accumulated attention.
        lengths: long [R], or one length for every lane.
    Returns:
        bool [R, E], within `valid`: the full cache keeps every valid entry.
    """
    special, punct = classes
    lengths = torch.as_tensor(lengths).expand(valid.shape[0]).cpu()
    kept_special = valid & special

    def local(r_local: float) -> torch.Tensor:
        oldest = (lengths - ratio_budget(r_local, lengths)).to(valid.device)
        return valid & (positions >= oldest[:, None])

    masks = ladder_masks(
        settings, kept_special, kept_special | (valid & punct),
        lambda r_frequent: top_scored(scores[None], valid[None], ratio_budget(r_frequent, lengths))[0], local,
    )
    options = torch.stack([*masks, valid])  # indexed by policy id; the full cache last
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
        policies: long [kv_heads], policy ids (`FastGenSettings.ladder`, then the full cache).
        classes: (special, punct), bool [num_tokens] each, for every token the sequence will hold.
        settings: the ladder.
    """

    def __init__(
        self, policies: torch.Tensor, classes: tuple[torch.Tensor, torch.Tensor], settings: FastGenSettings
    ) -> None:
        self.policies, self.classes, self.settings = policies, classes, settings

    def keep(self, visible: torch.Tensor, scores: torch.Tensor, length: int) -> torch.Tensor:
        classes = (self.classes[0][:length], self.classes[1][:length])
        one_row = torch.tensor([length])
        masks = policy_masks(visible[:, None], classes, scores[:, None], one_row, self.settings)[:, :, 0]
        options = torch.cat([masks, visible[None]])  # [policies, kv_heads, length]; the full cache keeps all it saw
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
