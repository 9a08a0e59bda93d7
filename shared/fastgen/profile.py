"""FastGen's profiling: from a layer's prompt attention, the cheapest policy per KV head that recovers enough of it.

Owns the recovered-mass criterion and the choice. What each policy keeps is `kept`'s; the attention probabilities
are `causal_row_probs`' (the FastGen harness's too).

Recovered mass: for a profiled query row at position i, the share of its full-softmax attention that falls on the keys
it would see while decoding under the policy: the policy's kept set over the i tokens before it (budgets
ceil(r x i)), plus its own key, which a step always sees. Row i ranks heavy hitters by the attention each key received
from the profiled rows before it (summed over the KV head's query heads), as a decode step ranks them by the steps
before it; ranking by every profiled row would let a row see its own and later rows' attention. A KV head
recovers the minimum over its query heads of their mean over the profiled rows, and gets the first cheap policy whose
lost mass (1 - recovered) is at most 1 - T, else full. Cost per layer: the last W rows' attention, heads x W x n
float64 (plus one such mask per cheap policy), and a sort of kv_heads x W x n scores for the heavy hitters. With W
below the prompt length the first profiled rows rank on the attention of few rows (the first on none: ties go to the
earliest keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.fastgen.kept import policy_masks
from shared.fastgen.policies import FastGenSettings


def causal_row_probs(q_rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal attention probabilities of the last W query rows over every key, softmax in float64.

    Args:
        q_rows: [W, num_heads, head_dim], the queries at positions n - W .. n - 1; k: [n, num_kv_heads, head_dim]
            (GQA: query head h reads KV head h // (num_heads / num_kv_heads)).
    Returns:
        float64 [num_heads, W, n]; zero past each row's position.
    """
    num_rows, num_heads, head_dim = q_rows.shape
    num_tokens = k.shape[0]
    keys = k.repeat_interleave(num_heads // k.shape[1], dim=1).transpose(0, 1)  # [num_heads, n, head_dim]
    logits = q_rows.transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(head_dim)  # [num_heads, W, n]
    rows = torch.arange(num_tokens - num_rows, num_tokens, device=k.device)
    future = torch.arange(num_tokens, device=k.device)[None, :] > rows[:, None]
    return logits.double().masked_fill(future, -math.inf).softmax(dim=-1)


@dataclass(frozen=True)
class LayerProfile:
    """One layer's profile.

    Attributes:
        policies: long [kv_heads], the policy id chosen per KV head (`FastGenSettings.ladder`, then the full cache).
        lost: float64 [len(ladder), kv_heads], the attention mass each cheap policy loses (the maximum over
            the group's query heads of the mean over profiled rows); recovered = 1 - lost.
        scores: float64 [kv_heads, n], each key's attention summed over the profiled rows and the group's query heads.
    """

    policies: torch.Tensor
    lost: torch.Tensor
    scores: torch.Tensor


def profile_layer(
    probs: torch.Tensor, classes: tuple[torch.Tensor, torch.Tensor], num_kv_heads: int, settings: FastGenSettings
) -> LayerProfile:
    """Choose each KV head's policy from its query heads' attention over the prompt.

    Args:
        probs: [num_heads, W, n], the causal attention probabilities of the prompt's last W query rows (positions
            n - W .. n - 1) over its n keys; query head h belongs to KV head h // (num_heads / num_kv_heads).
        classes: (special, punct), bool [n] each, the prompt tokens' classes.
        num_kv_heads: KV heads of the layer.
        settings: T and the ladder.
    Raises:
        ValueError: the shapes do not fit (heads not a multiple of num_kv_heads, W > n, classes not [n]).
    """
    num_heads, num_rows, num_keys = probs.shape
    if num_heads % num_kv_heads or num_rows > num_keys or classes[0].shape != (num_keys,):
        raise ValueError(f"attention {tuple(probs.shape)} does not fit {num_kv_heads} KV heads and {num_keys} keys")
    group = num_heads // num_kv_heads
    probs = probs.double()
    per_row = probs.view(num_kv_heads, group, num_rows, num_keys).sum(dim=1)  # [kv_heads, W, n]
    before = per_row.cumsum(dim=1) - per_row  # what each row's ranking has seen: the profiled rows before it
    positions = torch.arange(num_keys - num_rows, num_keys)  # each row's position = tokens before it
    key = torch.arange(num_keys)
    visible = (key[None, :] < positions[:, None]).expand(num_kv_heads, num_rows, num_keys)
    masks = policy_masks(visible, classes, before, positions, settings)  # [policies, kv_heads, W, n]
    itself = key[None, :] == positions[:, None]  # [W, n]: a step always sees its own key
    lost = torch.stack([
        (probs * ~(mask | itself).repeat_interleave(group, dim=0)).sum(dim=-1).mean(dim=-1)  # [num_heads]
        for mask in masks
    ])
    lost = lost.view(len(masks), num_kv_heads, group).amax(dim=-1)  # the worst-served query head
    return LayerProfile(choose_policies(lost, settings.threshold), lost, before[:, -1] + per_row[:, -1])


def choose_policies(lost: torch.Tensor, threshold: float) -> torch.Tensor:
    """The first cheap policy per KV head that loses at most 1 - T of the attention mass, else the full cache (the
    id one past the cheap ones).

    T = 1 keeps everything: a cheap policy that loses nothing on the prompt may still lose mass as decoding goes on.

    Args:
        lost: [len(ladder), kv_heads], as `LayerProfile.lost`.
    Returns:
        long [kv_heads].
    """
    if threshold >= 1:
        return torch.full(lost.shape[1:], lost.shape[0], dtype=torch.long)
    good_enough = torch.cat([lost <= 1 - threshold, torch.ones_like(lost[:1], dtype=torch.bool)])
    return good_enough.int().argmax(dim=0).long()  # argmax of 0/1: the first True (the full row is all True)


def policy_counts(policies: torch.Tensor, settings: FastGenSettings) -> dict[str, int]:
    """How many heads each policy has, by label, every policy listed (zeros too), cheapest first."""
    return {label: int((policies == policy).sum()) for policy, label in enumerate(settings.labels())}
