"""The DRAM tier: LRU order, the byte bound, what eviction returns, refusal of oversize blocks, stats."""

from __future__ import annotations

import pytest

from shared.cache.dram import DramTier


def test_put_get_has_remove_and_sizes() -> None:
    tier: DramTier[bytes] = DramTier(100)
    assert tier.put(1, b"a" * 10) == []
    assert tier.put(2**64 - 1, b"b" * 20) == []
    assert tier.get(2**64 - 1) == b"b" * 20
    assert tier.has(1) and not tier.has(3)
    assert (tier.num_blocks, tier.num_bytes) == (2, 30)
    assert tier.remove(1) and not tier.remove(1)
    assert (tier.num_blocks, tier.num_bytes) == (1, 20)
    assert tier.get(1) is None


def test_evicts_least_recently_used_first_and_get_refreshes() -> None:
    tier: DramTier[bytes] = DramTier(30)
    for h in (1, 2, 3):
        tier.put(h, bytes(10))
    assert tier.get(1) is not None  # 1 is now the most recent; 2 the oldest
    assert tier.has(2)  # has() does not refresh
    assert tier.put(4, bytes(10)) == [2]
    assert tier.put(5, bytes(20)) == [3, 1]
    assert tier.hashes() == [4, 5]
    assert tier.num_bytes == 30


def test_byte_bound_holds_with_mixed_sizes() -> None:
    tier: DramTier[bytes] = DramTier(1000)
    evicted: list[int] = []
    for h in range(200):
        evicted += tier.put(h, bytes(1 + (h * 37) % 300))
        assert tier.num_bytes <= 1000
    assert tier.num_blocks + len(evicted) == 200
    assert evicted == sorted(evicted)  # never touched again, so evicted in put order
    assert tier.num_bytes == sum(1 + (h * 37) % 300 for h in tier.hashes())


def test_replacing_a_block_counts_its_new_size_and_makes_it_recent() -> None:
    tier: DramTier[bytes] = DramTier(30)
    tier.put(1, bytes(10))
    tier.put(2, bytes(10))
    assert tier.put(1, bytes(15)) == []
    assert tier.num_bytes == 25
    assert tier.put(3, bytes(10)) == [2]
    assert tier.get(1) == bytes(15)


def test_oversize_block_is_refused_without_evicting() -> None:
    tier: DramTier[bytes] = DramTier(50)
    tier.put(1, bytes(50))
    with pytest.raises(ValueError, match="exceeds the capacity"):
        tier.put(2, bytes(51))
    assert tier.hashes() == [1] and tier.num_bytes == 50
    with pytest.raises(ValueError):
        DramTier(0)


def test_stats_count_hits_misses_evictions_and_clear_empties() -> None:
    tier: DramTier[bytes] = DramTier(20)
    tier.put(1, bytes(10))
    tier.put(2, bytes(10))
    tier.get(1)
    tier.get(9)
    tier.get(9)
    tier.put(3, bytes(20))
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.evictions) == (1, 2, 2)
    assert tier.clear() == [3]
    assert (tier.num_blocks, tier.num_bytes) == (0, 0)
    assert tier.put(4, bytes(20)) == []
