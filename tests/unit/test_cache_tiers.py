"""The tiers together: admission to SSD of blocks seen twice, drops reported as removed, promotion of SSD hits, read
leases that keep blocks from eviction, a corrupt SSD file as a reported miss, backpressure, stats."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_ssd_tier import make_block

from services.cache_store.tiers.block import StoredBlock
from services.cache_store.tiers.dram import DramTier
from services.cache_store.tiers.ssd import SsdTier
from services.cache_store.tiers.tiers import LEASE_S, TieredStore

BLOCK = 1000  # bytes of data per test block: DRAM of 3500 holds 3 (high mark 3325); a 4th put evicts 2 (low mark 2975)


class Harness:
    def __init__(self, folder: Path | None, dram_bytes: int = 3500) -> None:
        self.now = 0.0
        self.changes: list[tuple[str, list[int]]] = []
        ssd_tier = SsdTier(folder, 1 << 20) if folder is not None else None
        self.store = TieredStore(DramTier(dram_bytes), ssd_tier, self.on_change, clock=lambda: self.now)

    def on_change(self, kind: str, hashes: list[int]) -> None:
        assert self.store.holds(hashes[0]) == (kind == "stored")  # reported right after the change
        self.changes.append((kind, hashes))

    async def put(self, *hashes: int, parts: int = 1) -> None:
        for h in hashes:
            await self.store.put(h, block_of(h, parts))


def block_of(h: int, parts: int = 1) -> StoredBlock:
    return make_block(h, sizes=(BLOCK // parts,) * parts)


@pytest.fixture
async def harness(tmp_path: Path) -> Harness:
    h = Harness(tmp_path)
    await h.store.open()
    return h


async def test_only_blocks_seen_twice_go_to_ssd_the_rest_are_removed(harness: Harness) -> None:
    store = harness.store
    await harness.put(1)
    assert await store.get(1) == block_of(1)  # seen twice now; 2 and 3 will be seen once
    await harness.put(2, 3, 4)  # 4000 > 3325: the two least recently used, 1 and 2, go
    await store.flush()
    assert harness.changes == [("stored", [1]), ("stored", [2]), ("stored", [3]), ("removed", [2]), ("stored", [4])]
    assert store.ssd is not None and store.ssd.hashes() == [1] and not store.dram.has(1)
    assert store.holds(1) and not store.holds(2)
    stats = store.stats()
    assert (stats.num_admitted, stats.num_dropped, stats.dram.evictions, stats.num_blocks) == (1, 1, 2, 3)


async def test_an_ssd_hit_is_served_and_promoted_and_keeps_its_file(harness: Harness) -> None:
    store = harness.store
    await harness.put(1)
    await store.get(1)
    await harness.put(2, 3, 4)
    await store.flush()
    assert store.ssd is not None and store.ssd.has(1) and not store.dram.has(1)
    assert await store.get(1) == block_of(1)
    assert store.dram.has(1) and store.ssd.has(1)
    stats = store.stats()
    assert stats.ssd is not None and (stats.ssd.hits, stats.dram.misses, stats.dram.hits) == (1, 1, 1)
    num_changes = len(harness.changes)
    await harness.put(5, 6, 7)  # evicts 1 from DRAM again: its file is still there, nothing is written or reported
    await store.flush()
    assert store.ssd.has(1) and not store.dram.has(1) and store.stats().num_admitted == 1
    assert ("removed", [1]) not in harness.changes[num_changes:]


async def test_a_block_being_written_is_still_served(harness: Harness) -> None:
    store = harness.store
    await harness.put(1)
    await store.get(1)
    await harness.put(2, 3, 4)  # 1 is queued for SSD; the writer has not run yet
    assert store.stats().num_writing == 1 and store.holds(1)
    assert await store.get(1) == block_of(1)
    await store.flush()
    assert store.stats().num_writing == 0 and store.ssd is not None and store.ssd.has(1)


async def test_a_read_lease_keeps_a_block_until_every_part_was_served_or_it_expired(harness: Harness) -> None:
    store = harness.store
    await harness.put(1, parts=3)
    assert await store.get(1, part=0) is not None  # a reader started: leased
    await harness.put(2, 3, 4)  # over the high mark, but 1 may not go: 2 and 3 do
    assert store.dram.has(1) and not store.dram.has(2) and store.stats().num_leased == 1
    await store.get(1, part=1)
    await store.get(1, part=2)  # every part served: the lease ends
    assert store.stats().num_leased == 0

    await store.get(1, part=0)  # a reader that never finishes ...
    harness.now += LEASE_S + 0.1  # ... loses its lease when it expires
    await harness.put(5, 6)
    assert not store.dram.has(1) and store.dram.has(6)


async def test_when_every_block_is_leased_a_put_finds_no_room(harness: Harness) -> None:
    store = harness.store
    await harness.put(1, 2, 3, parts=2)
    for h in (1, 2, 3):
        await store.get(h, part=0)
    with pytest.raises(ValueError, match="no room"):
        await harness.put(4, 5)
    assert not store.holds(4)
    assert all(store.dram.has(h) for h in (1, 2, 3))


async def test_a_put_waits_for_lagging_ssd_writes_when_dram_is_short_of_room(harness: Harness) -> None:
    store = harness.store
    for h in (1, 2):
        await harness.put(h)
        await store.get(h)
    await harness.put(3, 4)  # 1 and 2 are queued for SSD: 2000 bytes still held beside DRAM's 2000
    assert store.stats().num_writing == 2
    await harness.put(5)  # 3000 + 2000 > 3500: it waits for the writes instead of failing
    assert store.stats().num_writing == 0 and store.ssd is not None and sorted(store.ssd.hashes()) == [1, 2]
    assert store.dram.hashes() == [3, 4, 5] and ("removed", [1]) not in harness.changes


async def test_a_corrupt_ssd_file_is_a_miss_reported_removed(harness: Harness) -> None:
    store = harness.store
    await harness.put(1)
    await store.get(1)
    await harness.put(2, 3, 4)
    await store.flush()
    assert store.ssd is not None
    path = store.ssd.path_of(1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert await store.get(1) is None
    assert harness.changes[-1] == ("removed", [1]) and not path.exists() and not store.holds(1)
    stats = store.stats()
    assert stats.num_corrupt == 1 and stats.ssd is not None and stats.ssd.misses == 1


async def test_reopening_the_ssd_tier_returns_its_blocks(tmp_path: Path) -> None:
    first = Harness(tmp_path)
    await first.store.open()
    await first.put(1, 2)
    await first.store.get(1)
    await first.store.get(2)
    await first.put(3, 4)
    await first.store.close()  # finishes the queued writes; DRAM (3, 4) is lost
    second = Harness(tmp_path)
    assert sorted(await second.store.open()) == [1, 2]
    assert await second.store.get(2) == block_of(2)
    await second.store.close()


async def test_without_ssd_every_eviction_is_a_removal() -> None:
    harness = Harness(None)
    assert await harness.store.open() == []
    await harness.put(1)
    await harness.store.get(1)
    await harness.put(2, 3, 4)
    assert harness.changes[-2:] == [("removed", [1, 2]), ("stored", [4])]
    stats = harness.store.stats()
    assert stats.ssd is None and stats.num_dropped == 2 and stats.dram.evictions == 2
