"""Attention contexts for the FastGen harness: the prompt's pass (full causal attention, keeping its K/V and showing
each layer's attention probabilities to the profiler) and decoding (several variants of one sequence side by side,
each KV head seeing only the keys its rule keeps).

Owns the visibility masks and the heavy-hitter accumulation during decoding. What a rule keeps is
`shared.fastgen.kept`'s, which policy a head gets `shared.fastgen.profile`'s, the figures `fastgen`'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from shared.fastgen.kept import KeptRule
from shared.fastgen.profile import causal_row_probs
from shared.tools.eval.fastgen_codecs import ServedKv


class PrefillAttention:
    """The prompt's pass: plain causal attention; keeps each layer's K/V and hands `observe` the probabilities of
    the last `profile_rows` query rows (every row if None or more than the prompt).

    Attributes:
        keys, values, keys_pre_rope: per layer, [n, num_kv_heads, head_dim], filled by the pass.
        profile_s: seconds spent computing the probabilities and in `observe`.
    """

    def __init__(self, profile_rows: int | None, observe: Callable[[int, torch.Tensor], None]) -> None:
        self.profile_rows, self.observe = profile_rows, observe
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.keys_pre_rope: list[torch.Tensor] = []
        self.profile_s = 0.0

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        """q: [n, num_heads, head_dim]; k, v: [n, num_kv_heads, head_dim]. Returns [n, num_heads, head_dim]."""
        self.keys.append(k.clone())
        self.values.append(v.clone())
        self.keys_pre_rope.append(k_pre_rope.clone())
        start = time.perf_counter()
        num_tokens = q.shape[0]
        first_row = num_tokens - min(num_tokens, self.profile_rows or num_tokens)
        self.observe(layer_idx, causal_row_probs(q[first_row:], k))
        self.profile_s += time.perf_counter() - start
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)


class DecodeAttention:
    """Variants of one sequence decoded side by side, one token each per step, after a shared prompt.

    Each step a variant's KV head sees the keys its rule kept after the step before, plus the step's own key; every
    key it sees accumulates the step's attention (summed over the head's query heads, on top of the prompt's
    `scores`); then the rule picks what stays. `rules[b][layer]` is variant b's rule for a layer. The `coded`
    variants' K/V are rewritten each step to what the engine would serve over a codec (`ServedKv`).

    Args:
        prefill: the prompt's pass (its K/V per layer).
        scores: per layer, float64 [num_kv_heads, n], the prompt's accumulated attention.
        rules: per variant, per layer.
        max_len: tokens the sequence will reach.
        coded: the variants whose K/V go through a codec, each a fresh `ServedKv` (default: none).
    Attributes:
        length: tokens so far (the prompt, then one more per `start_step`).
        visible_counts: long [variants, layers, num_kv_heads], keys each head saw in the last step.
    """

    def __init__(
        self, prefill: PrefillAttention, scores: Sequence[torch.Tensor], rules: Sequence[Sequence[KeptRule]],
        max_len: int, coded: Sequence[ServedKv] = (),
    ) -> None:
        num_variants, (num_tokens, num_kv_heads, head_dim) = len(rules), prefill.keys[0].shape
        self.rules, self.length = rules, num_tokens
        shape = (num_variants, num_kv_heads, max_len)
        self.k_cache = [self._cache(k, shape + (head_dim,)) for k in prefill.keys]  # [B, kv_heads, max_len, D]
        self.v_cache = [self._cache(v, shape + (head_dim,)) for v in prefill.values]
        self.scores = [torch.zeros(shape, dtype=torch.float64) for _ in prefill.keys]
        self.kept = [torch.zeros(shape, dtype=torch.bool) for _ in prefill.keys]
        everything = torch.ones(num_kv_heads, num_tokens, dtype=torch.bool)
        for layer, layer_scores in enumerate(scores):
            self.scores[layer][:, :, :num_tokens] = layer_scores
            for variant in range(num_variants):
                kept = rules[variant][layer].keep(everything, layer_scores, num_tokens)
                self.kept[layer][variant, :, :num_tokens] = kept
        self.visible_counts = torch.zeros(num_variants, len(prefill.keys), num_kv_heads, dtype=torch.long)
        self.coded = list(coded)
        for served in self.coded:
            for layer, k_pre_rope in enumerate(prefill.keys_pre_rope):
                b = served.variant
                served.begin(layer, self.k_cache[layer][b], self.v_cache[layer][b], k_pre_rope)

    @staticmethod
    def _cache(prompt: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        cache = torch.zeros(shape, dtype=prompt.dtype)
        cache[:, :, : prompt.shape[0]] = prompt.transpose(0, 1)
        return cache

    def start_step(self) -> int:
        """Make room for one more token per variant; returns its position."""
        self.length += 1
        return self.length - 1

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        """q: [variants, num_heads, head_dim]; k, v: [variants, num_kv_heads, head_dim], this step's token of each
        variant. Returns [variants, num_heads, head_dim]."""
        length, position = self.length, self.length - 1
        num_variants, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]
        k_cache[:, :, position], v_cache[:, :, position] = k, v
        for served in self.coded:
            b = served.variant
            served.step(layer_idx, k_cache[b], v_cache[b], k_pre_rope[b], length)
        visible = self.kept[layer_idx][:, :, :length].clone()  # [B, kv_heads, length]
        visible[:, :, position] = True
        self.visible_counts[:, layer_idx] = visible.sum(dim=-1)
        queries = q.view(num_variants, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, kv, group, D]
        logits = queries @ k_cache[:, :, :length].transpose(-1, -2) / math.sqrt(head_dim)  # [B, kv, group, length]
        probs = logits.masked_fill(~visible[:, :, None], -math.inf).softmax(dim=-1)
        out = probs @ v_cache[:, :, :length]  # [B, kv, group, D]
        scores = self.scores[layer_idx][:, :, :length]
        scores += probs.sum(dim=2)
        for variant, rules in enumerate(self.rules):
            kept = rules[layer_idx].keep(visible[variant], scores[variant], length)
            self.kept[layer_idx][variant, :, :length] = kept
        return out.reshape(num_variants, num_heads, head_dim)
