"""A committed block as the cache-store keeps it: its verified parts exactly as they were put (never recompressed).

Only the value type; where a block lives (DRAM, SSD) is `shared.cache.tiers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import BlockPut


@dataclass(frozen=True)
class StoredBlock:
    """A committed block: its parts in order, each with its codec, raw size and xxh3-64 checksum of `data`."""

    parts: tuple[BlockPut, ...]

    def __len__(self) -> int:
        return sum(len(part.data) for part in self.parts)
