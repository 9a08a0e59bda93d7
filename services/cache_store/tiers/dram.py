"""The cache-store's DRAM tier: block hash -> value, bounded in bytes, least recently used evicted first between a high
and a low watermark. It only keeps and evicts; what an eviction means (SSD, an event) is
`services.cache_store.tiers.tiers`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sized
from typing import Generic, TypeVar

V = TypeVar("V", bound=Sized)

HIGH_WATERMARK = 0.95  # past this fraction of the capacity a put evicts ...
LOW_WATERMARK = 0.85  # ... down to this one, so evictions come in batches, not one per put


class DramFullError(ValueError):
    """No room for a block: what would have to be evicted is pinned (leased), or held elsewhere (`extra_bytes`)."""


class DramTier(Generic[V]):
    """An LRU map from block hash (u64) to a value whose `len()` is its size in bytes (`bytes`, or a block of parts).

    Args:
        capacity_bytes: the most bytes held at once (sum of `len(value)`).
        high_watermark, low_watermark: fractions of the capacity (0 < low <= high <= 1).
    Raises:
        ValueError: a capacity below 1 or watermarks out of order.
    """

    def __init__(
        self, capacity_bytes: int, high_watermark: float = HIGH_WATERMARK, low_watermark: float = LOW_WATERMARK
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be at least 1, got {capacity_bytes}")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < low <= high <= 1, got low {low_watermark}, high {high_watermark}")
        self.capacity_bytes = capacity_bytes
        self.high_bytes = int(capacity_bytes * high_watermark)
        self.low_bytes = int(capacity_bytes * low_watermark)
        self._blocks: OrderedDict[int, V] = OrderedDict()  # least recently used first
        self._num_bytes = 0

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def put(
        self, block_hash: int, data: V, is_pinned: Callable[[int], bool] | None = None, extra_bytes: int = 0
    ) -> list[tuple[int, V]]:
        """Store (or replace) a block as the most recently used.

        When the block would take the tier past the high watermark, the least recently used unpinned blocks are
        evicted until it fits under the low one (or no more can go).

        Args:
            block_hash, data: the block.
            is_pinned: blocks that must not be evicted now (read leases).
            extra_bytes: bytes the caller still holds for earlier evictions; they count against the capacity.
        Returns:
            The evicted (hash, value) pairs, oldest first (never `block_hash` itself).
        Raises:
            ValueError: `data` alone is larger than the capacity.
            DramFullError: it still would not fit under the capacity. Nothing changes on either error.
        """
        size = len(data)
        if size > self.capacity_bytes:
            raise ValueError(f"block {block_hash:#x} of {size} bytes exceeds the capacity of {self.capacity_bytes}")
        old = self._blocks.get(block_hash)
        num_bytes = self._num_bytes - (len(old) if old is not None else 0) + size
        victims: list[int] = []
        if num_bytes > self.high_bytes:
            for h, value in self._blocks.items():
                if num_bytes <= self.low_bytes:
                    break
                if h != block_hash and not (is_pinned and is_pinned(h)):
                    victims.append(h)
                    num_bytes -= len(value)
        if num_bytes + extra_bytes > self.capacity_bytes:
            raise DramFullError(f"no room for block {block_hash:#x} of {size} bytes")
        evicted = [(h, self._blocks[h]) for h in victims]
        for h in victims:
            self.remove(h)
        self.remove(block_hash)
        self._blocks[block_hash] = data
        self._num_bytes += size
        return evicted

    def get(self, block_hash: int) -> V | None:
        """The block, now the most recently used; None when absent."""
        data = self._blocks.get(block_hash)
        if data is not None:
            self._blocks.move_to_end(block_hash)
        return data

    def has(self, block_hash: int) -> bool:
        """Whether the block is held; does not change recency."""
        return block_hash in self._blocks

    def remove(self, block_hash: int) -> V | None:
        """Drop one block; the value when it was held."""
        data = self._blocks.pop(block_hash, None)
        if data is not None:
            self._num_bytes -= len(data)
        return data

    def clear(self) -> list[int]:
        """Drop every block; returns the hashes that were held."""
        hashes = list(self._blocks)
        self._blocks.clear()
        self._num_bytes = 0
        return hashes

    def hashes(self) -> list[int]:
        """Every held hash, least recently used first."""
        return list(self._blocks)
