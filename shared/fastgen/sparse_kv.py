"""One FastGen sequence's KV in lane slots: per layer and KV head (a lane), the entries of the tokens its policy
keeps, a decode step's attention over them, and the eviction after each step.

K and V of an entry lie in the pool, in the lane slots `lanes.LaneSlots` hands out; the entry's position, token
class and accumulated attention lie here. Entry e of a lane lives in the lane's slot e // block_size, row
e % block_size. Entries are in no particular order (attention does not care): an evicted entry's place is taken by
one of the lane's last entries, so a step moves only as many entries as it evicts, and a lane's trailing slots go
back once empty. What a policy keeps is `kept.kept_entries`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.fastgen.kept import kept_entries
from shared.fastgen.lanes import LaneSlots
from shared.fastgen.policies import FastGenSettings


class SparseKv:
    """A sequence's lanes.

    Args:
        lanes: the slot allocator (over the engine's block manager).
        pool: the KV pool tensor, [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim].
        policies: long [num_layers, num_kv_heads], each lane's `Policy`.
        settings: r_l and r_f.
        capacity: entries per lane to make room for at first (grown as needed).
    """

    def __init__(
        self, lanes: LaneSlots, pool: torch.Tensor, policies: torch.Tensor, settings: FastGenSettings, capacity: int
    ) -> None:
        num_layers, _, num_kv_heads, self.num_blocks, self.block_size, self.head_dim = pool.shape
        self.lanes, self.settings, self.device = lanes, settings, pool.device
        self.rows = pool.view(-1, self.head_dim)
        self.policies = policies.to(self.device)
        self.length = 0  # tokens of the sequence so far (kept or not)
        shape = (num_layers, num_kv_heads, max(capacity, 1))
        self.positions = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.special = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.punct = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.counts = torch.zeros(num_layers, num_kv_heads, dtype=torch.long, device=self.device)
        self.slot_table = torch.zeros(num_layers, num_kv_heads, 1, dtype=torch.long, device=self.device)
        self.row_bases = torch.zeros_like(self.slot_table)  # each slot's first K row in `rows`
        self.v_offset = num_kv_heads * self.num_blocks * self.block_size  # V's rows follow K's by this many
        self.num_slots = [[0] * num_kv_heads for _ in range(num_layers)]

    @property
    def num_entries(self) -> int:
        """Entries held, every lane (each is one token of one layer and KV head, K and V)."""
        return int(self.counts.sum())

    @property
    def num_slots_held(self) -> int:
        return sum(map(sum, self.num_slots))

    # ---- room -------------------------------------------------------------------------------------------------

    def slots_missing(self, num_new: torch.Tensor | int = 1) -> list[tuple[int, int]]:
        """The (layer, head) lanes, one per missing slot, that need a new slot to add `num_new` entries (per lane,
        long [num_layers, num_kv_heads], or the same for all)."""
        wanted = (self.counts + num_new).tolist()
        missing = []
        for layer, row in enumerate(wanted):
            for head, count in enumerate(row):
                needed = -(-count // self.block_size) - self.num_slots[layer][head]
                missing.extend([(layer, head)] * max(0, needed))
        return missing

    def reserve(self, num_new: torch.Tensor | int = 1) -> None:
        """Make room for `num_new` more entries in every lane (per lane, or the same for all).

        Raises:
            OutOfBlocks: the pool cannot supply the slots; nothing changes.
        """
        missing = self.slots_missing(num_new)
        slots = self.lanes.take(len(missing)) if missing else []
        self._grow(max(int((self.counts + num_new).max()), 1))
        for (layer, head), slot in zip(missing, slots, strict=True):
            self.slot_table[layer, head, self.num_slots[layer][head]] = slot
            self.row_bases[layer, head, self.num_slots[layer][head]] = self._row_base(slot)
            self.num_slots[layer][head] += 1

    def release(self) -> None:
        """Give every slot back."""
        slots = [int(self.slot_table[layer, head, i]) for layer, row in enumerate(self.num_slots)
                 for head, count in enumerate(row) for i in range(count)]
        self.lanes.give_back(slots)
        self.num_slots = [[0] * len(row) for row in self.num_slots]
        self.counts.zero_()

    def _grow(self, entries: int) -> None:
        """Capacity for `entries` per lane, in the metadata and the slot table."""
        if entries > self.positions.shape[-1]:
            extra = max(entries, 2 * self.positions.shape[-1]) - self.positions.shape[-1]
            for name in ("positions", "scores", "special", "punct"):
                old = getattr(self, name)
                setattr(self, name, torch.cat([old, old.new_zeros(*old.shape[:2], extra)], dim=-1))
        slots = -(-entries // self.block_size)
        if slots > self.slot_table.shape[-1]:
            extra = 2 * slots - self.slot_table.shape[-1]
            for name in ("slot_table", "row_bases"):
                old = getattr(self, name)
                setattr(self, name, torch.cat([old, old.new_zeros(*old.shape[:2], extra)], dim=-1))

    # ---- entries ----------------------------------------------------------------------------------------------

    def _flat_rows(self, layer: int, entries: torch.Tensor) -> torch.Tensor:
        """Rows of `self.rows` holding the K of entries [kv_heads, E] (entry indices per head) of a layer's lanes;
        their V is `v_offset` rows further."""
        bases = self.row_bases[layer].gather(1, torch.div(entries, self.block_size, rounding_mode="floor"))
        return bases + entries % self.block_size

    def _row_base(self, slot: int) -> int:
        """The row of K of a slot's first entry."""
        block, layer, head = self.lanes.locate(slot)
        return ((layer * 2 * self.lanes.num_kv_heads + head) * self.num_blocks + block) * self.block_size

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, special: torch.Tensor,
        punct: torch.Tensor,
    ) -> None:
        """Add tokens to every lane of a layer (room reserved beforehand).

        Args:
            k, v: [n, num_kv_heads, head_dim]; positions, special, punct: [n], per token.
        """
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, n, head_dim]
        num_kv_heads, num_new = k.shape[:2]
        entries = self.counts[layer][:, None] + torch.arange(num_new, device=self.device)  # [kv_heads, n]
        rows = self._flat_rows(layer, entries)
        self.rows[rows] = k.to(self.rows.dtype)
        self.rows[rows + self.v_offset] = v.to(self.rows.dtype)
        for name, values in (("positions", positions), ("special", special), ("punct", punct)):
            target = getattr(self, name)[layer]
            target.scatter_(1, entries, values.to(self.device).expand(num_kv_heads, num_new))
        self.scores[layer].scatter_(1, entries, torch.zeros_like(entries, dtype=torch.float32))
        self.counts[layer] += num_new

    def append_kept(
        self, layer: int, kv: torch.Tensor, keep: torch.Tensor, scores: torch.Tensor,
        classes: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Add a prompt's kept tokens to a layer's lanes (room reserved beforehand), each head its own.

        Args:
            kv: [2, num_kv_heads, n, head_dim], K and V of every prompt token; keep: bool [num_kv_heads, n];
            scores: [num_kv_heads, n], the profile's accumulated attention; classes: (special, punct), bool [n].
        """
        for head in range(keep.shape[0]):
            kept = keep[head].nonzero().flatten().to(self.device)
            entries = self.counts[layer, head] + torch.arange(kept.numel(), device=self.device)
            rows = self.row_bases[layer, head, entries // self.block_size] + entries % self.block_size
            self.rows[rows] = kv[0, head, kept].to(self.rows.dtype)
            self.rows[rows + self.v_offset] = kv[1, head, kept].to(self.rows.dtype)
            self.positions[layer, head, entries] = kept
            self.scores[layer, head, entries] = scores[head].to(self.device, torch.float32)[kept]
            self.special[layer, head, entries] = classes[0].to(self.device)[kept]
            self.punct[layer, head, entries] = classes[1].to(self.device)[kept]
            self.counts[layer, head] += kept.numel()

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """`attend_lanes` for this sequence alone. q: [num_heads, head_dim]."""
        return attend_lanes([self], layer, q[None], scale)[0]

    def entry_rows(self, layer: int, num_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of K and of V of a layer's first `num_entries` entries per lane, long [num_kv_heads, num_entries]
        each; entries past a lane's count repeat a held one (the caller masks them)."""
        counts = self.counts[layer]
        entries = torch.arange(num_entries, device=self.device).expand(counts.shape[0], num_entries)
        entries = torch.minimum(entries, (counts - 1).clamp(min=0)[:, None])
        rows = self._flat_rows(layer, entries)
        return rows, rows + self.v_offset

    def evict(self, layer: int) -> None:
        """`evict_lanes` for this sequence alone."""
        evict_lanes([self], layer)

    def compact(self, layer: int, keep: torch.Tensor) -> None:
        """Keep a layer's entries where `keep` (bool [num_kv_heads, E], E = the layer's largest count) says: the
        lanes' last kept entries move into the holes; emptied trailing slots go back."""
        num_kv_heads, num_entries = keep.shape
        entries = torch.arange(num_entries, device=self.device).expand(num_kv_heads, num_entries)
        kept = keep.sum(dim=1)
        holes = (~keep & (entries < kept[:, None])).nonzero(as_tuple=True)  # row-major: paired head by head
        movers = (keep & (entries >= kept[:, None])).nonzero(as_tuple=True)
        if holes[0].numel():
            rows = self._flat_rows(layer, entries)
            for offset in (0, self.v_offset):
                self.rows[rows[holes] + offset] = self.rows[rows[movers] + offset]
            for name in ("positions", "scores", "special", "punct"):
                target = getattr(self, name)[layer]
                target[holes] = target[movers]
        self.counts[layer] = kept
        self._trim(layer, kept.tolist())

    def _trim(self, layer: int, kept: list[int]) -> None:
        freed = []
        for head, count in enumerate(kept):
            needed = -(-count // self.block_size)
            held = self.num_slots[layer][head]
            if held > needed:
                freed.extend(self.slot_table[layer, head, needed:held].tolist())
                self.num_slots[layer][head] = needed
        if freed:
            self.lanes.give_back(freed)


def attend_lanes(sequences: list[SparseKv], layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence over its layer's entries (each token's own, appended first, included), every
    sequence in one batched product; the attention each entry gets, summed over its head's query heads, adds to the
    entry's score.

    Args:
        sequences: lanes of one pool; q: [len(sequences), num_heads, head_dim].
    Returns:
        [len(sequences), num_heads, head_dim].
    """
    first = sequences[0]
    num_seqs, num_heads, head_dim = q.shape
    counts = torch.stack([sparse.counts[layer] for sparse in sequences])  # [S, kv_heads]
    num_kv_heads, num_entries = counts.shape[1], int(counts.max())
    rows = [sparse.entry_rows(layer, num_entries) for sparse in sequences]
    k_rows = torch.stack([k for k, _ in rows]).flatten()
    v_rows = torch.stack([v for _, v in rows]).flatten()
    keys = first.rows.index_select(0, k_rows).view(num_seqs * num_kv_heads, num_entries, head_dim)
    values = first.rows.index_select(0, v_rows).view(num_seqs * num_kv_heads, num_entries, head_dim)
    queries = q.reshape(num_seqs * num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = torch.bmm(queries, keys.transpose(1, 2)).float().mul_(scale)  # [S * kv_heads, group, E]
    padding = torch.arange(num_entries, device=q.device) >= counts.reshape(-1, 1)  # [S * kv_heads, E]
    logits.masked_fill_(padding[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    received = probs.sum(dim=1).view(num_seqs, num_kv_heads, num_entries)
    for sparse, scores in zip(sequences, received, strict=True):
        sparse.scores[layer, :, :num_entries] += scores[:, : sparse.scores.shape[-1]]
    return torch.bmm(probs.to(q.dtype), values).view(num_seqs, num_heads, head_dim)


def evict_lanes(sequences: list[SparseKv], layer: int) -> None:
    """Apply each lane's policy after a step over its sequence's `length` tokens (every sequence's lanes of the layer
    judged at once), then `compact` the sequences that drop something."""
    first = sequences[0]
    counts = torch.stack([sparse.counts[layer] for sparse in sequences])  # [S, kv_heads]
    num_seqs, num_kv_heads = counts.shape
    num_entries = int(counts.max())

    def lanes(name: str) -> torch.Tensor:  # [S * kv_heads, E], each sequence's metadata padded to E
        return torch.cat([F.pad(getattr(s, name)[layer, :, :num_entries], (0, max(
            0, num_entries - getattr(s, name).shape[-1]))) for s in sequences])

    valid = (torch.arange(num_entries, device=first.device) < counts.reshape(-1, 1))
    lengths = torch.tensor([sparse.length for sparse in sequences]).repeat_interleave(num_kv_heads)
    policies = torch.cat([sparse.policies[layer] for sparse in sequences])
    keep = kept_entries(policies, lanes("positions"), valid, (lanes("special"), lanes("punct")), lanes("scores"),
                        lengths, first.settings).view(num_seqs, num_kv_heads, num_entries)
    valid = valid.view(num_seqs, num_kv_heads, num_entries)
    for sparse, seq_keep, seq_valid, seq_counts in zip(sequences, keep, valid, counts, strict=True):
        held = int(seq_counts.max())
        if not torch.equal(seq_keep, seq_valid):
            sparse.compact(layer, seq_keep[:, :held])
