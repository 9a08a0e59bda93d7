"""One FastGen sequence's KV in lane slots: per layer and KV head (a lane), the entries of the tokens its policy
keeps, a decode step's attention over them, and the eviction after each step.

K and V of an entry lie in the pool, in the lane slots `lanes.LaneSlots` hands out, in the form the pool's
`lane_store` keeps them (raw rows, or kvquant records); the entry's position, token class and accumulated attention
lie here. Entry e of a lane lives in the lane's slot e // slot_entries, at index e % slot_entries. Entries are in no
particular order (attention does not care): an evicted entry's place is taken by one of the lane's last entries, so
a step moves only as many entries as it evicts, and a lane's trailing slots go back once empty. Over a lossy store
the sequence's first token (the attention sink) is also kept whole here, and replaces its decoded entry. What a
policy keeps is `kept.kept_entries`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine.kv.fastgen.lane_store import LaneStore
from shared.engine.kv.fastgen.lanes import LaneSlots
from shared.fastgen.kept import kept_entries
from shared.fastgen.policies import FastGenSettings


class SparseKv:
    """A sequence's lanes.

    Args:
        lanes: the slot allocator (over the engine's block manager).
        store: where and how the pool holds entries.
        policies: long [num_layers, num_kv_heads], each lane's policy id (`FastGenSettings`).
        settings: the ladder of policies.
        capacity: entries per lane to make room for at first (grown as needed).
    """

    def __init__(
        self, lanes: LaneSlots, store: LaneStore, policies: torch.Tensor, settings: FastGenSettings, capacity: int
    ) -> None:
        num_layers, num_kv_heads = policies.shape
        self.lanes, self.store, self.settings, self.device = lanes, store, settings, store.device
        self.slot_entries = store.slot_entries
        self.policies = policies.to(self.device)
        self.length = 0  # tokens of the sequence so far (kept or not)
        shape = (num_layers, num_kv_heads, max(capacity, 1))
        self.positions = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.special = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.punct = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.counts = torch.zeros(num_layers, num_kv_heads, dtype=torch.long, device=self.device)
        self.slot_table = torch.zeros(num_layers, num_kv_heads, 1, dtype=torch.long, device=self.device)
        self.slot_bases = torch.zeros_like(self.slot_table)  # each slot's first entry's address in the store
        self.num_slots = [[0] * num_kv_heads for _ in range(num_layers)]
        self.ring: int | None = None  # the store's ring of this sequence's newest positions (`lane_store`), if any
        # over a lossy store: K and V of position 0 per lane, whole (K after RoPE is K before it at position 0)
        self.sink = torch.zeros(num_layers, num_kv_heads, 2, store.head_dim, dtype=store.dtype, device=self.device) \
            if store.lossy else None

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
                needed = -(-count // self.slot_entries) - self.num_slots[layer][head]
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
            self.slot_bases[layer, head, self.num_slots[layer][head]] = self.store.slot_base(slot)
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
        slots = -(-entries // self.slot_entries)
        if slots > self.slot_table.shape[-1]:
            extra = 2 * slots - self.slot_table.shape[-1]
            for name in ("slot_table", "slot_bases"):
                old = getattr(self, name)
                setattr(self, name, torch.cat([old, old.new_zeros(*old.shape[:2], extra)], dim=-1))

    # ---- entries ----------------------------------------------------------------------------------------------

    def addresses(self, layer: int, entries: torch.Tensor) -> torch.Tensor:
        """Store addresses of entries [kv_heads, E] (entry indices per head) of a layer's lanes."""
        bases = self.slot_bases[layer].gather(1, torch.div(entries, self.slot_entries, rounding_mode="floor"))
        return bases + entries % self.slot_entries * self.store.entry_stride

    def note(self, layer: int, positions: torch.Tensor, special: torch.Tensor, punct: torch.Tensor) -> torch.Tensor:
        """Enter n new tokens' metadata in every lane of a layer (room reserved beforehand); returns the addresses
        their K/V go to, long [num_kv_heads, n] (the caller writes them)."""
        num_kv_heads, num_new = self.counts.shape[1], positions.numel()
        entries = self.counts[layer][:, None] + torch.arange(num_new, device=self.device)  # [kv_heads, n]
        for name, values in (("positions", positions), ("special", special), ("punct", punct)):
            target = getattr(self, name)[layer]
            target.scatter_(1, entries, values.to(self.device).expand(num_kv_heads, num_new))
        self.scores[layer].scatter_(1, entries, torch.zeros_like(entries, dtype=torch.float32))
        self.counts[layer] += num_new
        return self.addresses(layer, entries)

    def append_kept(
        self, layer: int, kv: torch.Tensor, keep: torch.Tensor, scores: torch.Tensor,
        classes: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Add a prompt's kept tokens to a layer's lanes (room reserved beforehand), each head its own.

        Args:
            kv: [2, num_kv_heads, n, head_dim], K (as the store takes them) and V of every prompt token;
            keep: bool [num_kv_heads, n]; scores: [num_kv_heads, n], the profile's accumulated attention;
            classes: (special, punct), bool [n].
        """
        self.keep_sink(layer, torch.arange(min(1, kv.shape[2])), kv[0], kv[1])
        for head in range(keep.shape[0]):
            kept = keep[head].nonzero().flatten().to(self.device)
            entries = self.counts[layer, head] + torch.arange(kept.numel(), device=self.device)
            addresses = self.addresses(layer, entries[None].expand(keep.shape[0], -1))[head]
            self.store.write(layer, torch.full_like(kept, head), addresses, kv[0, head, kept], kv[1, head, kept])
            self.positions[layer, head, entries] = kept
            self.scores[layer, head, entries] = scores[head].to(self.device, torch.float32)[kept]
            self.special[layer, head, entries] = classes[0].to(self.device)[kept]
            self.punct[layer, head, entries] = classes[1].to(self.device)[kept]
            self.counts[layer, head] += kept.numel()

    def keep_sink(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Over a lossy store, keep position 0's K and V (k, v: [kv_heads, n, head_dim]) whole."""
        if self.sink is not None and positions.numel() and int(positions[0]) == 0:
            self.sink[layer, :, 0], self.sink[layer, :, 1] = k[:, 0], v[:, 0]

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """`attend_lanes` for this sequence alone. q: [num_heads, head_dim]."""
        return attend_lanes([self], layer, q[None], scale)[0]

    def entry_addresses(self, layer: int, num_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Addresses and positions of a layer's first `num_entries` entries per lane, long [num_kv_heads,
        num_entries] each; entries past a lane's count repeat a held one (the caller masks them)."""
        counts = self.counts[layer]
        entries = torch.arange(num_entries, device=self.device).expand(counts.shape[0], num_entries)
        entries = torch.minimum(entries, (counts - 1).clamp(min=0)[:, None])
        return self.addresses(layer, entries), self.positions[layer].gather(1, entries)

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
            addresses = self.addresses(layer, entries)
            self.store.move(addresses[movers], addresses[holes])
            for name in ("positions", "scores", "special", "punct"):
                target = getattr(self, name)[layer]
                target[holes] = target[movers]
        self.counts[layer] = kept
        self._trim(layer, kept.tolist())

    def _trim(self, layer: int, kept: list[int]) -> None:
        freed = []
        for head, count in enumerate(kept):
            needed = -(-count // self.slot_entries)
            held = self.num_slots[layer][head]
            if held > needed:
                freed.extend(self.slot_table[layer, head, needed:held].tolist())
                self.num_slots[layer][head] = needed
        if freed:
            self.lanes.give_back(freed)


def append_lanes(
    sequences: list[SparseKv], layer: int, k: torch.Tensor, v: torch.Tensor, special: torch.Tensor,
    punct: torch.Tensor,
) -> None:
    """One token per sequence, at position `length - 1`, into every lane of a layer (room reserved beforehand), in
    one store write.

    Args:
        k, v: [len(sequences), num_kv_heads, head_dim], keys as the store takes them; special, punct: bool [S].
    """
    store = sequences[0].store
    num_seqs, num_kv_heads, head_dim = k.shape
    addresses = []
    for row, sparse in enumerate(sequences):
        position = torch.tensor([sparse.length - 1])
        addresses.append(sparse.note(layer, position, special[row : row + 1], punct[row : row + 1]))
        sparse.keep_sink(layer, position, k[row, :, None], v[row, :, None])
    heads = torch.arange(num_kv_heads, device=k.device).repeat(num_seqs)
    store.write(layer, heads, torch.cat(addresses).flatten(), k.reshape(-1, head_dim), v.reshape(-1, head_dim))
    if store.window:
        rings = torch.tensor([sparse.ring for sparse in sequences], device=k.device)
        positions = torch.tensor([sparse.length - 1 for sparse in sequences], device=k.device)
        store.write_ring(layer, rings, positions, k, v)


def attend_lanes(sequences: list[SparseKv], layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence over its layer's entries (each token's own, appended first, included), every
    sequence in one batched product; the attention each entry gets, summed over its head's query heads, adds to the
    entry's score.

    Args:
        sequences: lanes of one pool; q: [len(sequences), num_heads, head_dim].
    Returns:
        [len(sequences), num_heads, head_dim].
    """
    store = sequences[0].store
    num_seqs, num_heads, head_dim = q.shape
    counts = torch.stack([sparse.counts[layer] for sparse in sequences])  # [S, kv_heads]
    num_kv_heads, num_entries = counts.shape[1], int(counts.max())
    found = [sparse.entry_addresses(layer, num_entries) for sparse in sequences]
    addresses = torch.stack([a for a, _ in found])  # [S, kv_heads, E]
    positions = torch.stack([p for _, p in found])
    heads = torch.arange(num_kv_heads, device=q.device)[None, :, None].expand_as(addresses)
    recent = None
    if store.window:  # entries among the newest `window` positions read their sequence's ring
        lengths = torch.tensor([sparse.length for sparse in sequences], device=q.device)
        rings = torch.tensor([sparse.ring for sparse in sequences], device=q.device)
        recent = (rings[:, None, None].expand_as(addresses).flatten(),
                  (positions >= (lengths - store.window)[:, None, None]).flatten())
    keys, values = (x.view(num_seqs, num_kv_heads, num_entries, head_dim) for x in store.read(
        layer, heads.flatten(), addresses.flatten(), positions.flatten(), recent))
    if store.lossy:  # the sink, whole
        sinks = torch.stack([sparse.sink[layer] for sparse in sequences if sparse.sink is not None])
        is_sink = (positions == 0)[..., None]
        keys = torch.where(is_sink, sinks[:, :, None, 0], keys)
        values = torch.where(is_sink, sinks[:, :, None, 1], values)
    keys = keys.reshape(num_seqs * num_kv_heads, num_entries, head_dim)
    values = values.reshape(num_seqs * num_kv_heads, num_entries, head_dim)
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
