"""The step's attention when the engine runs FastGen: sequences whose KV is in lanes decode over them (their rows come
first), every other row goes through the paged pool as usual, and prompts completed by this step are profiled.

Owns the split of the step's rows and which prompts are profiled; the lanes are `kv`'s, the profile `shared.fastgen`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.batching import ScheduledChunk
from shared.engine.kv.fastgen.kv import FastGenKv
from shared.model.llama import AttentionContext


@dataclass(frozen=True)
class _Profiled:
    """A prompt this step completes: its rows among the paged rows and its blocks."""

    request_id: str
    first_row: int
    num_rows: int
    context_len: int
    block_ids: list[int]


def split_chunks(
    chunks: list[ScheduledChunk], fastgen: FastGenKv
) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
    """(chunks of sequences in lanes, the others), each in the plan's order; the step runs them in that order."""
    in_lanes = [c for c in chunks if fastgen.holds(c.seq.request_id)]
    return in_lanes, [c for c in chunks if not fastgen.holds(c.seq.request_id)]


class FastGenAttention:
    """The model's `AttentionContext` for a step with lane rows [0, S) and paged rows after them.

    Args:
        paged: the inner store's context of the paged rows (its rows count from the first paged one).
        fastgen: the engine's lanes (their store reads a profiled prompt's keys from the paged pool).
        lane_chunks: one decode token each, in row order.
        paged_chunks: the others, in row order.
        block_tables: of the paged chunks.
    """

    def __init__(
        self, paged: AttentionContext, fastgen: FastGenKv, lane_chunks: list[ScheduledChunk],
        paged_chunks: list[ScheduledChunk], block_tables: dict[str, list[int]],
    ) -> None:
        self.paged, self.fastgen = paged, fastgen
        self.request_ids = [c.seq.request_id for c in lane_chunks]
        self.token_ids = [c.seq.token_ids[c.seq.num_computed_tokens] for c in lane_chunks]
        self.profiled: list[_Profiled] = []
        row = 0
        for chunk in paged_chunks:
            seq = chunk.seq
            if chunk.completes_sequence and fastgen.wants_profile(seq.request_id):
                context_len = seq.num_computed_tokens + chunk.num_tokens
                fastgen.start_profile(seq.request_id, seq.token_ids[:context_len])
                self.profiled.append(_Profiled(
                    seq.request_id, row, chunk.num_tokens, context_len, block_tables[seq.request_id]
                ))
            row += chunk.num_tokens

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        num_lane_rows = len(self.request_ids)
        lane_keys = k_pre_rope if self.fastgen.store.keys_before_rope else k
        if num_lane_rows == q.shape[0]:
            return self.fastgen.attend(layer_idx, self.request_ids, q, lane_keys, v, self.token_ids)
        out = torch.empty_like(q)
        paged = slice(num_lane_rows, None)
        out[paged] = self.paged.attend(layer_idx, q[paged], k[paged], v[paged], k_pre_rope[paged])
        for prompt in self.profiled:
            # the keys the chunk attended to: the pool's before it, its own as computed (a codec pool stores them
            # coded, but the chunk attends to itself in full precision)
            keys = self.fastgen.store.prompt_keys(layer_idx, prompt.request_id, prompt.block_ids, prompt.context_len)
            keys = keys.transpose(0, 1)  # [n, kv_heads, D]
            rows = slice(num_lane_rows + prompt.first_row, num_lane_rows + prompt.first_row + prompt.num_rows)
            keys[prompt.context_len - prompt.num_rows :] = k[rows]
            self.fastgen.observe(prompt.request_id, layer_idx, q[rows], keys)
        if num_lane_rows:
            lanes = slice(0, num_lane_rows)
            out[lanes] = self.fastgen.attend(layer_idx, self.request_ids, q[lanes], lane_keys[lanes], v[lanes],
                                             self.token_ids)
        return out
