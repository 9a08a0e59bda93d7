"""The cache-store's DRAM tier: block hash -> value, bounded in total bytes, least recently used evicted first.

It only keeps and evicts; what an eviction means (an event, a move to SSD) is up to the caller. No torch, no asyncio.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sized
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V", bound=Sized)


@dataclass
class DramStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class DramTier(Generic[V]):
    """An LRU map from block hash (u64) to a value whose `len()` is its size in bytes (`bytes`, or a block of parts).

    Args:
        capacity_bytes: the most bytes held at once (sum of `len(value)`).
    Raises:
        ValueError: a capacity below 1.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be at least 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[int, V] = OrderedDict()  # least recently used first
        self._num_bytes = 0
        self._stats = DramStats()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def put(self, block_hash: int, data: V) -> list[int]:
        """Store (or replace) a block as the most recently used, evicting the least recently used to make room.

        Returns:
            The hashes evicted, oldest first (never `block_hash` itself).
        Raises:
            ValueError: `data` alone is larger than the capacity (nothing is evicted then).
        """
        size = len(data)
        if size > self.capacity_bytes:
            raise ValueError(f"block {block_hash:#x} of {size} bytes exceeds the capacity of {self.capacity_bytes}")
        self.remove(block_hash)
        evicted: list[int] = []
        while self._num_bytes + size > self.capacity_bytes:
            old_hash, old = self._blocks.popitem(last=False)
            self._num_bytes -= len(old)
            evicted.append(old_hash)
        self._stats.evictions += len(evicted)
        self._blocks[block_hash] = data
        self._num_bytes += size
        return evicted

    def get(self, block_hash: int) -> V | None:
        """The block, now the most recently used; None (a miss) when absent."""
        data = self._blocks.get(block_hash)
        if data is None:
            self._stats.misses += 1
            return None
        self._blocks.move_to_end(block_hash)
        self._stats.hits += 1
        return data

    def has(self, block_hash: int) -> bool:
        """Whether the block is held; does not change recency or stats."""
        return block_hash in self._blocks

    def remove(self, block_hash: int) -> bool:
        """Drop one block; True when it was held."""
        data = self._blocks.pop(block_hash, None)
        if data is None:
            return False
        self._num_bytes -= len(data)
        return True

    def clear(self) -> list[int]:
        """Drop every block; returns the hashes that were held."""
        hashes = list(self._blocks)
        self._blocks.clear()
        self._num_bytes = 0
        return hashes

    def hashes(self) -> list[int]:
        """Every held hash, least recently used first (a snapshot for resyncing listeners)."""
        return list(self._blocks)

    def stats(self) -> DramStats:
        """A copy of the hit, miss and eviction counters."""
        return DramStats(self._stats.hits, self._stats.misses, self._stats.evictions)
