"""The DRAM tier: LRU order, eviction between the high and low watermarks, pinned blocks, refusals, sizes."""

from __future__ import annotations

import random

import pytest

from services.cache_store.tiers.dram import DramFullError, DramTier


def hashes_of(evicted: list[tuple[int, bytes]]) -> list[int]:
    return [h for h, _ in evicted]


def test_put_get_has_remove_and_sizes() -> None:
    tier: DramTier[bytes] = DramTier(100)
    assert tier.put(1, b"a" * 10) == []
    assert tier.put(2**64 - 1, b"b" * 20) == []
    assert tier.get(2**64 - 1) == b"b" * 20
    assert tier.has(1) and not tier.has(3)
    assert (tier.num_blocks, tier.num_bytes) == (2, 30)
    assert tier.remove(1) == b"a" * 10 and tier.remove(1) is None
    assert (tier.num_blocks, tier.num_bytes) == (1, 20)
    assert tier.get(1) is None


def test_crossing_the_high_mark_evicts_least_recently_used_down_to_the_low_mark() -> None:
    tier: DramTier[bytes] = DramTier(100, high_watermark=0.9, low_watermark=0.5)
    for h in range(9):
        assert tier.put(h, bytes(10)) == []  # 90 bytes: at the high mark, not past it
    assert tier.get(0) is not None  # 0 is now the most recent; 1 the oldest
    assert tier.has(1)  # has() does not refresh
    evicted = tier.put(9, bytes(10))  # 100 > 90: down to 50
    assert hashes_of(evicted) == [1, 2, 3, 4, 5] and all(v == bytes(10) for _, v in evicted)
    assert tier.hashes() == [6, 7, 8, 0, 9] and tier.num_bytes == 50
    assert tier.put(10, bytes(30)) == []  # 80: under the high mark, nothing goes


def test_pinned_blocks_are_skipped_and_no_room_changes_nothing() -> None:
    tier: DramTier[bytes] = DramTier(100, high_watermark=0.9, low_watermark=0.5)
    for h in range(9):
        tier.put(h, bytes(10))
    assert hashes_of(tier.put(9, bytes(10), is_pinned=lambda h: h < 3)) == [3, 4, 5, 6, 7]
    assert tier.hashes() == [0, 1, 2, 8, 9]
    with pytest.raises(DramFullError):
        tier.put(10, bytes(60), is_pinned=lambda h: True)  # 110 > 100 and nothing may go
    assert tier.hashes() == [0, 1, 2, 8, 9] and tier.num_bytes == 50


def test_extra_bytes_held_elsewhere_count_against_the_capacity_not_the_marks() -> None:
    tier: DramTier[bytes] = DramTier(100, high_watermark=0.9, low_watermark=0.5)
    tier.put(1, bytes(40))
    assert tier.put(2, bytes(40), extra_bytes=20) == []  # 80 <= 90, and 80 + 20 <= 100
    with pytest.raises(DramFullError):
        tier.put(3, bytes(40), extra_bytes=80, is_pinned=lambda h: True)
    assert hashes_of(tier.put(3, bytes(40), extra_bytes=50)) == [1, 2]  # down to 40; 40 + 50 fits


def test_oversize_block_and_bad_settings_are_refused() -> None:
    tier: DramTier[bytes] = DramTier(50)
    tier.put(1, bytes(50))
    with pytest.raises(ValueError, match="exceeds the capacity"):
        tier.put(2, bytes(51))
    assert tier.hashes() == [1] and tier.num_bytes == 50
    with pytest.raises(ValueError):
        DramTier(0)
    with pytest.raises(ValueError):
        DramTier(100, high_watermark=0.5, low_watermark=0.6)


def test_replacing_a_block_counts_its_new_size_and_makes_it_recent() -> None:
    tier: DramTier[bytes] = DramTier(30, high_watermark=1.0, low_watermark=1.0)
    tier.put(1, bytes(10))
    tier.put(2, bytes(10))
    assert tier.put(1, bytes(15)) == []
    assert tier.num_bytes == 25
    assert hashes_of(tier.put(3, bytes(10))) == [2]
    assert tier.get(1) == bytes(15)


def test_byte_bound_holds_with_mixed_sizes_and_clear_empties() -> None:
    tier: DramTier[bytes] = DramTier(1000)
    rng = random.Random(3)
    evicted: list[int] = []
    for h in range(300):
        if rng.random() < 0.3 and tier.num_blocks:
            tier.get(rng.choice(tier.hashes()))
        evicted += hashes_of(tier.put(h, bytes(rng.randint(1, 300))))
        assert tier.num_bytes <= tier.capacity_bytes
        assert tier.num_bytes == sum(len(tier.get(x) or b"") for x in tier.hashes())
    assert tier.num_blocks + len(evicted) == 300
    assert sorted(tier.clear() + evicted) == list(range(300))
    assert (tier.num_blocks, tier.num_bytes) == (0, 0)
