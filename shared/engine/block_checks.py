"""The block manager's self-check (`BlockManager.check_invariants`): every block in exactly one state, reference counts
equal to the tables that hold each block, the prefix-cache index consistent with the blocks and their tokens.

Tests and property checks call it after every operation; the manager itself never does (it is O(blocks)).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING

from shared.wire.block_hash import block_hashes

if TYPE_CHECKING:
    from shared.engine.blocks import _Seq
    from shared.engine.prefix_index import PrefixIndex


class InvariantChecks:
    """Mixed into `BlockManager`; reads its state and its `PrefixIndex`'s."""

    _num_blocks: int
    _block_size: int
    _namespace: bytes
    _ref_counts: list[int]
    _free: deque[int]
    _prefix_index: PrefixIndex
    _seqs: dict[Hashable, _Seq]
    _raw: set[int]

    def check_invariants(self) -> None:
        """Raise AssertionError if block states, reference counts or the prefix index are inconsistent."""
        index = self._prefix_index
        block_hash_of, evictable_lru = index.block_hash, index.evictable
        holders = [0] * self._num_blocks
        for seq_id, seq in self._seqs.items():
            self._check_seq(seq_id, seq)
            for block_id in seq.block_ids:
                holders[block_id] += 1
        for block_id in self._raw:
            holders[block_id] += 1
            _require(block_hash_of[block_id] is None, f"raw block {block_id} is registered")
        _require(holders == self._ref_counts, f"ref counts {self._ref_counts} != table holders {holders}")
        free, evictable = set(self._free), set(evictable_lru)
        referenced = {b for b in range(self._num_blocks) if self._ref_counts[b] > 0}
        _require(len(free) == len(self._free), "a block is twice on the free list")
        num_in_states = len(free) + len(evictable) + len(referenced)
        _require(
            len(free | evictable | referenced) == num_in_states == self._num_blocks,
            f"blocks not in exactly one state: free {free}, evictable {evictable}, referenced {referenced}",
        )
        for block_id in free:
            _require(block_hash_of[block_id] is None, f"free block {block_id} is registered")
        for block_id, block_hash in evictable_lru.items():
            _require(block_hash_of[block_id] == block_hash, f"evictable block {block_id} not registered")
        for block_hash, block_id in index.by_hash.items():
            _require(block_hash_of[block_id] == block_hash, f"index entry {block_hash:#x} -> {block_id}")
        num_registered = sum(1 for h in block_hash_of if h is not None)
        _require(num_registered == len(index.by_hash), "a block is registered outside the index")
        num_with_tokens = sum(1 for t in index.block_tokens if t is not None)
        _require(num_with_tokens == num_registered, "stored block tokens out of step with registrations")
        for block_hash, copies in index.copies.items():
            holder = index.by_hash.get(block_hash)
            is_held = bool(copies) and holder is not None and self._ref_counts[holder] > 0
            _require(is_held, f"copies {copies} of {block_hash:#x} outlive its referenced registration")
            for block_id in copies:
                _require(block_hash_of[block_id] is None, f"copy {block_id} of {block_hash:#x} is registered")

    def _check_seq(self, seq_id: Hashable, seq: _Seq) -> None:
        size, index = self._block_size, self._prefix_index
        expected = block_hashes(seq.token_ids, size, self._namespace)
        _require(len(seq.block_ids) == -(-len(seq.token_ids) // size), f"{seq_id!r}: table size")
        _require(len(set(seq.block_ids)) == len(seq.block_ids), f"{seq_id!r}: a block twice in one table")
        _require(0 <= seq.num_computed <= len(seq.token_ids), f"{seq_id!r}: num_computed out of range")
        _require(seq.hashes == expected[: len(seq.hashes)], f"{seq_id!r}: stale chained hashes")
        num_full = seq.num_computed // size
        _require(seq.num_published <= num_full, f"{seq_id!r}: published past the computed blocks")
        _require(seq.is_loading or seq.num_published == num_full, f"{seq_id!r}: computed blocks left unpublished")
        for i, block_id in enumerate(seq.block_ids):
            where = f"{seq_id!r} block {i} (id {block_id})"
            if index.block_hash[block_id] is None:
                # A published block is registered or a tracked copy (a 64-bit hash collision would fail here too).
                is_accounted = i >= seq.num_published or block_id in index.copies.get(expected[i], [])
                _require(is_accounted, f"{where}: published but neither registered nor a copy")
                continue
            _require(i < seq.num_published, f"{where}: registered but not computed (or still loading)")
            _require(index.block_hash[block_id] == expected[i], f"{where}: hash mismatch")
            tokens = seq.token_ids[i * size : (i + 1) * size]
            _require(index.block_tokens[block_id] == tokens, f"{where}: holds other tokens")



def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
