"""The global block index: which blocks each prefill instance's local cache and each cache-store shard hold, kept
from their KV events, resynced from a snapshot on a gap in an instance's events, a new epoch, or an instance that joins
a scheduler started after it.

It answers prefix questions for placement; it does not decide anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.wire.protocol import KvEvent, Snapshot


@dataclass
class _Holdings:
    epoch: int
    last_seq: int
    blocks: set[int] = field(default_factory=set)
    resyncing: bool = False
    buffered: list[KvEvent] = field(default_factory=list)  # events that arrived while a snapshot was asked for


class BlockIndex:
    """Holdings per instance. `apply` returns True when the instance needs a snapshot (the caller asks for one and
    hands the answer to `load_snapshot`); until then its events are buffered and its old holdings kept."""

    def __init__(self) -> None:
        self._holdings: dict[str, _Holdings] = {}

    def apply(self, event: KvEvent) -> bool:
        held = self._holdings.get(event.instance_id)
        if (held is None or held.epoch != event.epoch) and event.seq == 0:
            fresh = _Holdings(event.epoch, -1)  # a new epoch seen from its first event: nothing was missed
            self._holdings[event.instance_id] = fresh
            _apply(fresh, event)
            return False
        if held is None or held.epoch != event.epoch:
            # Joined late, or a restart whose first events we missed: learn the state from a snapshot.
            self._holdings[event.instance_id] = _Holdings(event.epoch, -1, resyncing=True, buffered=[event])
            return True
        if held.resyncing and event.seq == 0 and held.last_seq == -1 and not held.buffered:
            held.resyncing = False  # asked for on joining, but here is its first event: nothing was missed
            _apply(held, event)
            return False
        if held.resyncing:
            held.buffered.append(event)
            return False
        if event.seq <= held.last_seq:
            return False  # a duplicate
        if event.seq != held.last_seq + 1:
            held.resyncing, held.buffered = True, [event]
            return True
        _apply(held, event)
        return False

    def load_snapshot(self, snapshot: Snapshot) -> None:
        """Replace an instance's holdings with the snapshot, then replay buffered events newer than it."""
        held = self._holdings.get(snapshot.instance_id)
        if held is not None and held.epoch != snapshot.epoch and held.buffered:
            return  # a newer epoch began meanwhile; its own snapshot is on its way
        if held is not None and not held.resyncing and held.epoch == snapshot.epoch and held.last_seq >= snapshot.seq:
            return  # its events since told as much
        buffered = held.buffered if held is not None else []
        fresh = _Holdings(snapshot.epoch, snapshot.seq, set(snapshot.block_hashes))
        self._holdings[snapshot.instance_id] = fresh
        for event in sorted(buffered, key=lambda e: e.seq):
            if event.epoch == snapshot.epoch and event.seq > fresh.last_seq:
                _apply(fresh, event)  # a gap among buffered events is caught by the next live one

    def needs_snapshot(self, instance_id: str, epoch: int) -> bool:
        """An instance joined whose holdings in `epoch` this index does not know: a scheduler started after it (a
        restarted one) has heard none of its past events. True: its events are buffered from now and the caller asks
        for a snapshot (then `load_snapshot`, or `resync_failed`)."""
        held = self._holdings.get(instance_id)
        if held is not None and held.epoch == epoch:
            return False
        self._holdings[instance_id] = _Holdings(epoch, -1, resyncing=True)
        return True

    def resync_failed(self, instance_id: str) -> None:
        """No snapshot came: drop what we knew (placing on stale data is worse than on none), unless its events have
        told it all meanwhile."""
        held = self._holdings.get(instance_id)
        if held is not None and held.resyncing:
            del self._holdings[instance_id]

    def forget(self, instance_id: str) -> None:
        self._holdings.pop(instance_id, None)

    def holds(self, instance_id: str, block_hash: int) -> bool:
        held = self._holdings.get(instance_id)
        return held is not None and block_hash in held.blocks

    def num_blocks(self, instance_id: str) -> int:
        held = self._holdings.get(instance_id)
        return len(held.blocks) if held is not None else 0

    def is_resyncing(self, instance_id: str) -> bool:
        held = self._holdings.get(instance_id)
        return held is not None and held.resyncing

    def prefix_len(self, instance_id: str, block_hashes: list[int]) -> int:
        """How many leading blocks of a request this one instance holds."""
        held = self._holdings.get(instance_id)
        if held is None:
            return 0
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held.blocks:
                break
            count += 1
        return count

    def pool_prefix_len(self, store_ids: list[str], block_hashes: list[int]) -> int:
        """How many leading blocks the cache-store holds, on any of its shards."""
        stores = [self._holdings[i].blocks for i in store_ids if i in self._holdings]
        count = 0
        for block_hash in block_hashes:
            if not any(block_hash in blocks for blocks in stores):
                break
            count += 1
        return count


def _apply(held: _Holdings, event: KvEvent) -> None:
    held.last_seq = event.seq
    if event.kind == "cleared":
        held.blocks.clear()
    elif event.kind == "stored":
        held.blocks.update(event.block_hashes)
    elif event.kind == "removed":
        held.blocks.difference_update(event.block_hashes)
