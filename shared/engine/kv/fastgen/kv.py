"""FastGen inside the engine: profile each prompt as its last chunk is computed, move the kept KV of the profiled
sequence from its blocks into lanes (freeing the blocks), then decode it over its lanes, evicting after every step.

Owns which requests are profiled, pending or in lanes, and the figures the engine reports (entries and bytes held,
bytes saved). The storage is `sparse_kv`'s and `lanes`'; the policies `shared.fastgen.profile`'s and `kept`'s.

Profiling uses the query rows of the chunk that completes the prompt, at most `profile_rows` of its last (default
512): the attention of those rows over every key of the prompt, [num_heads, W, n] in float64, once per layer (for
SmolLM2 and W = 512, 37 KB per prompt token: 19 MB at 512 tokens, 300 MB at 8k). Fewer rows cost less but choose
worse: the first profiled rows rank heavy hitters on little history, which makes heavy-hitters-only look safe (README,
FastGen). A prompt computed in several chunks, or mostly reused from the prefix cache, is profiled on its last
chunk's rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shared.engine.blocks import BlockManager, OutOfBlocks
from shared.engine.kv.fastgen.lane_store import LaneStore
from shared.engine.kv.fastgen.lanes import LaneSlots
from shared.engine.kv.fastgen.sparse_kv import SparseKv, append_lanes, attend_lanes, evict_lanes
from shared.env_vars import default_int
from shared.fastgen.kept import kept_entries
from shared.fastgen.policies import FastGenSettings
from shared.fastgen.profile import causal_row_probs, profile_layer
from shared.fastgen.token_classes import TokenClasses
from shared.wire.handoff.profile import PromptProfile

if TYPE_CHECKING:
    from shared.engine.sequence import Sequence

DEFAULT_PROFILE_ROWS = default_int("TSUKIMI_FASTGEN_PROFILE_ROWS")


@dataclass
class _Pending:
    """A prompt being profiled in this step: its tokens' classes and each layer's policies [num_kv_heads] and scores
    [num_kv_heads, n] as they come."""

    classes: tuple[torch.Tensor, torch.Tensor]
    policies: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)


class FastGenKv:
    """Every FastGen sequence of one engine.

    Args:
        settings: T, r_l, r_f and the rows profiled (None: `DEFAULT_PROFILE_ROWS`).
        classes: the vocabulary's special and punctuation tokens.
        block_manager: lanes are cut from its blocks.
        store: how the engine's pool holds lane entries (`lane_store`).
        num_layers, num_kv_heads: the model's.
        scale: the attention scale.
        hands_off: profile prompts but keep them in blocks, for `take_profile` (a prefill instance's engine hands
            each prompt's profile to decode with its KV).
    """

    def __init__(
        self, settings: FastGenSettings, classes: TokenClasses, block_manager: BlockManager, store: LaneStore,
        num_layers: int, num_kv_heads: int, scale: float, hands_off: bool = False,
    ) -> None:
        self.settings, self.classes, self.store, self.scale = settings, classes, store, scale
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.lanes = LaneSlots(block_manager, store.slots_per_block)
        self.sequences: dict[str, SparseKv] = {}
        self.pending: dict[str, _Pending] = {}
        self.declined: set[str] = set()  # profiled but no room for lanes: they stay in blocks
        self.hands_off = hands_off
        self.profiles: dict[str, PromptProfile] = {}  # profiled, waiting for `take_profile`
        self.entry_bytes = store.entry_bytes  # K and V of one token of one KV head, as the pool holds them

    @property
    def profile_rows(self) -> int:
        return self.settings.profile_rows or DEFAULT_PROFILE_ROWS

    def holds(self, request_id: str) -> bool:
        """Whether the request's KV is in lanes (not in blocks)."""
        return request_id in self.sequences

    def wants_profile(self, request_id: str) -> bool:
        return request_id not in self.sequences and request_id not in self.declined

    # ---- prefill: profile --------------------------------------------------------------------------------------

    def start_profile(self, request_id: str, token_ids: list[int]) -> None:
        """The step computes the last chunk of this request's prompt (`token_ids`)."""
        special, punct = self.classes.of(torch.tensor(token_ids))
        self.pending[request_id] = _Pending((special, punct))

    def observe(self, request_id: str, layer: int, q_rows: torch.Tensor, keys: torch.Tensor) -> None:
        """One layer of a pending prompt: q_rows [W, num_heads, head_dim], its last W query rows; keys
        [n, num_kv_heads, head_dim], every key of the prompt (RoPE applied to both)."""
        pending = self.pending[request_id]
        rows = q_rows[-self.profile_rows :]
        probs = causal_row_probs(rows.float(), keys.float())
        profile = profile_layer(probs.cpu(), pending.classes, self.num_kv_heads, self.settings)
        pending.policies.append(profile.policies)
        pending.scores.append(profile.scores.float())

    def convert(self, request_id: str, block_ids: list[int], num_tokens: int) -> bool:
        """Move a profiled prompt's kept KV from its blocks into lanes; False (it stays in blocks, for good) when the
        pool has no room for the lanes. The caller frees the blocks after True."""
        pending = self.pending.pop(request_id)
        policies = torch.stack(pending.policies)  # [num_layers, num_kv_heads]
        sparse = SparseKv(self.lanes, self.store, policies, self.settings, num_tokens + self.store.slot_entries)
        sparse.length = num_tokens
        everything = torch.ones(self.num_kv_heads, num_tokens, dtype=torch.bool)
        positions = torch.arange(num_tokens).expand(self.num_kv_heads, -1)
        classes = (pending.classes[0].expand(self.num_kv_heads, -1), pending.classes[1].expand(self.num_kv_heads, -1))
        kept = [  # what each layer keeps of the prompt, as after any step: bool [num_kv_heads, n]
            kept_entries(layer_policies, positions, everything, classes, scores, num_tokens, self.settings)
            for layer_policies, scores in zip(pending.policies, pending.scores, strict=True)
        ]
        try:
            sparse.reserve(torch.stack([keep.sum(dim=1) for keep in kept]).to(self.store.device))
        except OutOfBlocks:
            self.declined.add(request_id)
            return False
        sparse.ring = self.store.open_ring(request_id)
        recent = torch.arange(max(0, num_tokens - self.store.window), num_tokens, device=self.store.device)
        rings = torch.full_like(recent, sparse.ring or 0)
        for layer, (keep, scores) in enumerate(zip(kept, pending.scores, strict=True)):
            kv = self.store.read_prompt(layer, request_id, block_ids, num_tokens)  # [2, kv_heads, n, D]
            sparse.append_kept(layer, kv, keep, scores, pending.classes)
            if self.store.window:  # the prompt's newest tokens whole, as the pool held them
                self.store.write_ring(layer, rings, recent, kv[0, :, recent].transpose(0, 1),
                                      kv[1, :, recent].transpose(0, 1))
        self.sequences[request_id] = sparse
        return True

    def move_profiled(self, running: Mapping[str, Sequence], restarted: set[str]) -> None:
        """After a step: each prompt profiled in it moves to lanes and its blocks are freed (they stay in the prefix
        cache), or with `hands_off` waits for `take_profile`; one that finished, or whose step was void
        (`restarted`), is dropped."""
        block_manager = self.lanes.block_manager
        for request_id in list(self.pending):
            seq = running.get(request_id)
            if seq is None or request_id in restarted:
                self.release(request_id)
            elif self.hands_off:
                pending = self.pending.pop(request_id)
                self.profiles[request_id] = PromptProfile(torch.stack(pending.policies), torch.stack(pending.scores))
            elif self.convert(request_id, block_manager.block_ids(request_id), seq.num_computed_tokens):
                block_manager.free(request_id)

    def take_profile(self, request_id: str) -> PromptProfile | None:
        """The profile of a prompt this engine computed but does not decode (`hands_off`), once."""
        return self.profiles.pop(request_id, None)

    def adopt(self, request_id: str, token_ids: list[int], profile: PromptProfile, block_ids: list[int]) -> bool:
        """A prompt computed elsewhere, its KV now in `block_ids`, with the profile made there: into lanes, as
        `convert` (the caller frees the blocks after True)."""
        self.start_profile(request_id, token_ids)
        pending = self.pending[request_id]
        pending.policies, pending.scores = list(profile.policies), list(profile.scores.float())
        return self.convert(request_id, block_ids, len(token_ids))

    # ---- decode ------------------------------------------------------------------------------------------------

    def reserve(self, request_id: str) -> bool:
        """Room for one more token in every lane of the request; False when the pool has none."""
        try:
            self.sequences[request_id].reserve(1)
        except OutOfBlocks:
            return False
        return True

    def attend(
        self, layer: int, request_ids: list[str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        token_ids: list[int],
    ) -> torch.Tensor:
        """One decode token per request: append it to the request's lanes, attend, evict.

        Args:
            q: [S, num_heads, head_dim]; k, v: [S, num_kv_heads, head_dim]; token_ids: [S], the tokens themselves.
        Returns:
            [S, num_heads, head_dim].
        """
        special, punct = self.classes.of(torch.tensor(token_ids))
        sequences = [self.sequences[request_id] for request_id in request_ids]
        if layer == 0:
            for sparse in sequences:
                sparse.length += 1
        append_lanes(sequences, layer, k, v, special, punct)
        out = attend_lanes(sequences, layer, q, self.scale)
        evict_lanes(sequences, layer)
        return out

    def release(self, request_id: str) -> None:
        """The request finished or is preempted: give its lanes back, forget it."""
        sparse = self.sequences.pop(request_id, None)
        if sparse is not None:
            sparse.release()
        self.pending.pop(request_id, None)
        self.profiles.pop(request_id, None)
        self.declined.discard(request_id)

    # ---- figures -----------------------------------------------------------------------------------------------

    def bytes_held(self, request_id: str) -> int:
        """KV bytes the request's kept entries take (its lanes' slots take a little more: the last one per lane is
        partly empty)."""
        return self.sequences[request_id].num_entries * self.entry_bytes

    def total_bytes_saved(self) -> int:
        """`bytes_saved` summed over every request in lanes."""
        return sum(self.bytes_saved(request_id) for request_id in self.sequences)

    def bytes_saved(self, request_id: str) -> int:
        """KV bytes the request does not hold, against keeping every token of every lane."""
        sparse = self.sequences[request_id]
        full = sparse.length * self.num_layers * self.num_kv_heads
        return max(0, full - sparse.num_entries) * self.entry_bytes

