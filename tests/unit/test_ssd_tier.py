"""The SSD tier and its file format: round trips, every kind of corruption refused and deleted, temp files never
indexed, re-indexing a folder after a restart (recency by mtime), capacity eviction, pins, the folder lock."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from services.cache_store.tiers import blockfile, ssd
from services.cache_store.tiers.block import StoredBlock
from services.cache_store.tiers.blockfile import BlockFileError, encode_header, parse_block_file, parse_header
from services.cache_store.tiers.ssd import CorruptBlockError, SsdFullError, SsdTier
from shared.wire.payload import checksum
from shared.wire.protocol import BlockPut


def make_block(block_hash: int, sizes: tuple[int, ...] = (100, 50), seed: int = 0) -> StoredBlock:
    rng = random.Random(seed or block_hash)
    datas = [rng.randbytes(size) for size in sizes]
    return StoredBlock(tuple(
        BlockPut(block_hash, i, len(sizes), "lz4-shuffle" if i else "raw", 4 * size, checksum(data), data)
        for i, (size, data) in enumerate(zip(sizes, datas, strict=True))
    ))


def file_bytes(block_hash: int, block: StoredBlock) -> bytes:
    return encode_header(block_hash, block) + b"".join(p.data for p in block.parts)


def never(block_hash: int) -> bool:
    return False


def opened(folder: Path, capacity_bytes: int = 1 << 20) -> SsdTier:
    tier = SsdTier(folder, capacity_bytes)
    tier.open()
    return tier


def test_file_format_round_trips_and_refuses_damage() -> None:
    block = make_block(0xABC, sizes=(10, 0, 7))
    data = file_bytes(0xABC, block)
    assert parse_block_file(data, 0xABC) == block
    header = parse_header(data)
    assert header.file_len == len(data) and [p.data_len for p in header.parts] == [10, 0, 7]
    with pytest.raises(BlockFileError, match="not 0xabd"):
        parse_block_file(data, 0xABD)
    for position, why in [(0, "magic"), (4, "version"), (blockfile.HEAD.size, "header checksum"), (-1, "part 2")]:
        damaged = bytearray(data)
        damaged[position] ^= 0x40
        with pytest.raises(BlockFileError, match=why):
            parse_block_file(bytes(damaged), 0xABC)
    with pytest.raises(BlockFileError, match="bytes where the header says"):
        parse_block_file(data[:-1], 0xABC)
    with pytest.raises(ValueError, match="u64"):
        encode_header(-1, block)


async def test_put_get_round_trip_writes_one_named_file_and_no_temp(tmp_path: Path) -> None:
    tier = opened(tmp_path)
    block = make_block(0xDEADBEEF)
    assert await tier.put(0xDEADBEEF, block, never) == []
    assert tier.has(0xDEADBEEF) and tier.num_blocks == 1
    files = sorted(p.name for p in tmp_path.iterdir() if p.name != ssd.LOCK_NAME)
    assert files == ["00000000deadbeef.kvb"]
    assert tier.num_bytes == (tmp_path / files[0]).stat().st_size == len(file_bytes(0xDEADBEEF, block))
    assert await tier.get(0xDEADBEEF) == block
    assert await tier.get(0x1234) is None
    with pytest.raises(ValueError, match="already"):
        tier.reserve(0xDEADBEEF, block, never)


@pytest.mark.parametrize("damage", ["flip-data", "flip-header", "truncate", "delete"])
async def test_a_corrupt_file_is_refused_deleted_and_unindexed(tmp_path: Path, damage: str) -> None:
    tier = opened(tmp_path)
    await tier.put(7, make_block(7), never)
    await tier.put(8, make_block(8), never)
    path = tier.path_of(7)
    data = bytearray(path.read_bytes())
    if damage == "delete":
        path.unlink()
    else:
        if damage == "flip-data":
            data[-3] ^= 1
        elif damage == "flip-header":
            data[20] ^= 1
        else:
            del data[-10:]
        path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError):
        await tier.get(7)
    assert not tier.has(7) and not path.exists()
    assert tier.num_bytes == tier.path_of(8).stat().st_size
    assert await tier.get(7) is None
    assert await tier.get(8) == make_block(8)


async def test_reopening_the_folder_serves_the_blocks_again_in_mtime_order(tmp_path: Path) -> None:
    tier = opened(tmp_path)
    for h in (1, 2, 3):
        await tier.put(h, make_block(h), never)
    for age, h in enumerate((2, 3, 1)):  # 2 is the oldest, 1 the newest
        os.utime(tier.path_of(h), ns=(10**18 + age * 10**9, 10**18 + age * 10**9))
    tier.close()

    again = SsdTier(tmp_path, 1 << 20)
    report = again.open()
    assert (report.num_blocks, report.num_bytes) == (3, tier.num_bytes)
    assert again.hashes() == [2, 3, 1]
    assert await again.get(2) == make_block(2)
    assert again.hashes() == [3, 1, 2]  # a read makes it recent ...
    assert again.path_of(2).stat().st_mtime_ns > again.path_of(1).stat().st_mtime_ns  # ... across restarts too


async def test_reindex_drops_temp_and_corrupt_files_and_leaves_foreign_ones(tmp_path: Path) -> None:
    tier = opened(tmp_path)
    await tier.put(1, make_block(1), never)
    await tier.put(2, make_block(2), never)
    tier.close()
    temp = tmp_path / ".0000000000000003-0badcafe.kvb.tmp"  # a write cut short by a crash
    temp.write_bytes(file_bytes(3, make_block(3))[:50])
    (tmp_path / "0000000000000004.kvb").write_bytes(tier.path_of(2).read_bytes())  # block 2's bytes under 4's name
    (tmp_path / "0000000000000005.kvb").write_bytes(b"TKVB garbage")
    (tmp_path / "notes.txt").write_text("not ours")
    (tmp_path / "subdir").mkdir()

    again = SsdTier(tmp_path, 1 << 20)
    report = again.open()
    assert (report.num_blocks, report.num_temp_removed, report.num_corrupt_removed, report.num_unknown) == (2, 1, 2, 1)
    assert sorted(again.hashes()) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ssd.LOCK_NAME, "0000000000000001.kvb", "0000000000000002.kvb", "notes.txt", "subdir"
    ]


async def test_capacity_evicts_least_recently_used_and_skips_pinned(tmp_path: Path) -> None:
    size = len(file_bytes(1, make_block(1)))
    tier = opened(tmp_path, capacity_bytes=3 * size)
    for h in (1, 2, 3):
        assert await tier.put(h, make_block(h), never) == []
    await tier.get(1)  # 2 is now the least recently used
    assert await tier.put(4, make_block(4), never) == [2]
    assert await tier.put(5, make_block(5), lambda h: h == 3) == [1]
    assert sorted(tier.hashes()) == [3, 4, 5] and tier.num_bytes == 3 * size
    assert not tier.path_of(1).exists() and not tier.path_of(2).exists()
    with pytest.raises(SsdFullError, match="pinned"):
        tier.reserve(6, make_block(6), lambda h: True)
    with pytest.raises(SsdFullError, match="exceeds"):
        tier.reserve(7, make_block(7, sizes=(4 * size,)), never)
    assert sorted(tier.hashes()) == [3, 4, 5]


async def test_reopening_with_a_smaller_capacity_evicts_the_oldest(tmp_path: Path) -> None:
    tier = opened(tmp_path)
    for age, h in enumerate((5, 6, 7)):
        await tier.put(h, make_block(h), never)
        os.utime(tier.path_of(h), ns=(10**18 + age * 10**9,) * 2)
    tier.close()
    again = SsdTier(tmp_path, 2 * tier.num_bytes // 3)
    assert again.open().num_evicted == 1
    assert again.hashes() == [6, 7] and not again.path_of(5).exists()


async def test_a_failed_write_leaves_no_file_and_no_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = opened(tmp_path)

    async def broken_replace(src: object, dst: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(ssd.aiofiles.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        await tier.put(9, make_block(9), never)
    assert (tier.num_blocks, tier.num_bytes) == (0, 0)
    assert [p.name for p in tmp_path.iterdir()] == [ssd.LOCK_NAME]


def test_a_folder_serves_one_tier_at_a_time(tmp_path: Path) -> None:
    first = opened(tmp_path)
    with pytest.raises(OSError, match="in use"):
        SsdTier(tmp_path, 1 << 20).open()
    first.close()
    opened(tmp_path).close()
