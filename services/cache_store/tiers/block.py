"""A committed block as the cache-store keeps it: its verified parts exactly as they were put (never recompressed).

Only the value type; where a block lives (DRAM, SSD) is `services.cache_store.tiers.tiers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.wire.payload import CODEC_SIZE_ONLY
from shared.wire.protocol import BlockPut


def part_size(part: BlockPut) -> int:
    """Bytes a part counts for: its data, or for a size-only part (the sim engine's KV) the size it stands for."""
    return part.raw_size if part.codec == CODEC_SIZE_ONLY else len(part.data)


@dataclass(frozen=True)
class StoredBlock:
    """A committed block: its parts in order, each with its codec, raw size and xxh3-64 checksum of `data`."""

    parts: tuple[BlockPut, ...]

    def __len__(self) -> int:
        return sum(part_size(part) for part in self.parts)
