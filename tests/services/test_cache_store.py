"""The cache-store and its client against a real nats-server: multi-part round trips, misses, prefixes, eviction
events, two shards, corrupt parts, an absent store, handlers without NATS. (The SSD tier, restarts, snapshots,
replicas and the real `python -m services.cache_store` process: test_cache_store_tiers.py.)
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import math
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from cache_stack import Stack

from services.cache_store.service import CacheStoreService, stats_fields
from services.cache_store.tiers.block import StoredBlock
from shared.config import load_settings
from shared.wire.bus import BusError
from shared.wire.kv_events import MAX_EVENT_HASHES
from shared.wire.payload import checksum
from shared.wire.protocol import (
    Ack,
    BlockGet,
    BlockHas,
    BlockPart,
    BlockPut,
    Heartbeat,
    KvEvent,
    Message,
    Subjects,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    stack = Stack(nats_url)
    yield stack
    await stack.close()


async def until(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def float_block(num_bytes: int, seed: int) -> bytes:
    """Random bytes for the first third (nothing shrinks them), smooth float32 after (shuffled LZ4 does)."""
    noise = random.Random(seed).randbytes(num_bytes // 3)
    floats = array.array("f", (math.sin(i * 0.001) for i in range((num_bytes - len(noise)) // 4))).tobytes()
    return noise + floats + bytes(num_bytes - len(noise) - len(floats))


async def test_multi_part_block_round_trips_and_is_announced(stack: Stack) -> None:
    service = await stack.store()
    events = await stack.listen(stack.subjects.kv_events("cache-store", "cache-0"))
    beats = await stack.listen(stack.subjects.heartbeat_all)
    client = await stack.client()
    data = float_block(1_500_000, seed=1)

    assert await client.put_block(0xDEADBEEF, data)
    parts = service.store.dram.get(0xDEADBEEF)
    assert parts is not None and len(parts.parts) == 6  # 1.5 MB in parts of 256 KiB
    assert len({p.codec for p in parts.parts}) == 2  # noise stays raw, floats compress
    assert service.store.dram.num_bytes == len(parts) < len(data)
    assert await client.get_block(0xDEADBEEF) == data
    assert await client.has_blocks([0xDEADBEEF, 7]) == [True, False]

    await until(lambda: len(events) == 1)
    stored = KvEvent("cache-0", service.heartbeat.epoch, 1, "stored", [0xDEADBEEF], "cache-store")
    assert events[0] == stored  # 0: "cleared"
    assert await client.put_block(0xDEADBEEF, data)  # a re-put: acknowledged, nothing new
    assert service.events.next_seq == 2
    await until(lambda: any(isinstance(b, Heartbeat) and b.kv_blocks_used == 1 for b in beats))
    beat = next(b for b in beats if isinstance(b, Heartbeat))
    assert (beat.role, beat.instance_id, beat.epoch) == ("cache-store", "cache-0", service.heartbeat.epoch)


async def test_miss_and_longest_prefix(stack: Stack) -> None:
    await stack.store()
    client = await stack.client()
    assert await client.get_block(12345) is None
    for h in (10, 11, 12):
        assert await client.put_block(h, bytes([h]) * 1000)
    assert await client.longest_prefix([10, 11, 12, 13, 14]) == 3
    assert await client.longest_prefix([10, 13, 11]) == 1
    assert await client.longest_prefix([13, 10]) == 0
    assert await client.longest_prefix([]) == 0
    assert await client.get_block(11) == bytes([11]) * 1000


async def test_eviction_publishes_removed_and_the_block_then_misses(stack: Stack) -> None:
    service = await stack.store(dram_mb=1)
    events = await stack.listen(stack.subjects.kv_events("cache-store", "cache-0"))
    client = await stack.client()
    blocks = {h: random.Random(h).randbytes(400_000) for h in (1, 2, 3)}  # incompressible: 3 x 400 KB > 1 MiB
    for h, data in blocks.items():
        assert await client.put_block(h, data)

    await until(lambda: len(events) == 4)
    assert [(e.seq, e.kind, e.block_hashes) for e in events if isinstance(e, KvEvent)] == [
        (1, "stored", [1]), (2, "stored", [2]), (3, "removed", [1]), (4, "stored", [3])
    ]
    assert await client.get_block(1) is None
    assert await client.has_blocks([1, 2, 3]) == [False, True, True]
    assert await client.get_block(3) == blocks[3]
    stats = service.stats()
    assert stats.dram.num_bytes <= 1 << 20 and stats.dram.evictions == 1 and stats.num_dropped == 1
    assert (stats.dram.hits, stats.dram.misses, stats.ssd) == (1, 1, None)


async def test_two_shards_split_blocks_by_hash(stack: Stack) -> None:
    shards = [await stack.store(shard=i, num_shards=2) for i in range(2)]
    client = await stack.client(num_shards=2)
    for h in range(8):
        assert await client.put_block(h, f"block {h}".encode() * 100)
    for i, service in enumerate(shards):
        assert sorted(service.store.hashes()) == [h for h in range(8) if h % 2 == i]
    assert await client.has_blocks([7, 0, 100, 3]) == [True, True, False, True]
    assert await client.longest_prefix(list(range(10))) == 8
    assert [await client.get_block(h) for h in (4, 5)] == [b"block 4" * 100, b"block 5" * 100]


async def test_corrupt_parts_are_refused_and_never_served(stack: Stack) -> None:
    service = await stack.store()
    bus, client = await stack.bus(), await stack.client()
    put = bus.subjects.cache_put(0)
    good = BlockPut(77, 0, 2, "raw", 3, checksum(b"abc"), b"abc")
    assert (await bus.request(put, good, Ack)).ok
    with pytest.raises(BusError, match="failed its checksum"):
        await bus.request(put, BlockPut(77, 1, 2, "raw", 3, checksum(b"abc"), b"abX"), Ack)
    assert (await bus.request(put, BlockPut(77, 1, 2, "raw", 3, checksum(b"def"), b"def"), Ack)).ok
    assert await client.has_blocks([77]) == [False]  # part 0 went with the corrupt part 1
    assert await client.get_block(77) is None
    with pytest.raises(BusError, match="part 2 of 2"):  # refused as the message is decoded: no sender makes it
        await bus.request(put, BlockPut(78, 2, 2, "raw", 3, checksum(b"abc"), b"abc"), Ack)

    # A block damaged inside the store is refused by the client's own check.
    assert await client.put_block(79, b"x" * 1000)
    bad = StoredBlock((BlockPut(79, 0, 1, "raw", 4, checksum(b"good"), b"evil"),))
    service.store.dram.remove(79)
    service.store.dram.put(79, bad)
    assert await client.get_block(79) is None


async def test_absent_store_is_a_fast_miss(stack: Stack) -> None:
    client = await stack.client(num_shards=2, timeout_s=0.3)
    start = asyncio.get_running_loop().time()
    assert not await client.put_block(1, b"data" * 100_000)
    assert await client.get_block(1) is None
    assert await client.has_blocks([1, 2]) == [False, False]
    assert await client.longest_prefix([1, 2]) == 0
    assert asyncio.get_running_loop().time() - start < 2.0


class FakeBus:
    """Just enough of `Bus` for calling the handlers directly: subjects and a publish that records."""

    def __init__(self) -> None:
        self.subjects = Subjects("fake")
        self.published: list[tuple[str, Message]] = []

    async def publish(self, subject: str, msg: Message) -> None:
        self.published.append((subject, msg))


async def test_handlers_without_nats_expire_unfinished_puts_and_refuse_oversize_blocks() -> None:
    now = [0.0]
    settings = load_settings("cache-store", environ={"TSUKIMI_CACHE_DRAM_MB": "1", "TSUKIMI_INSTANCE_ID": "c"})
    bus = FakeBus()
    service = CacheStoreService(settings, bus, clock=lambda: now[0])  # type: ignore[arg-type]
    part0, part1 = (BlockPut(5, i, 2, "raw", 2, checksum(b"ab"), b"ab") for i in range(2))
    assert (await service.handle_put(part0)).ok
    now[0] = 31.0  # past PENDING_TIMEOUT_S: part 0 is forgotten, part 1 starts a new put
    assert (await service.handle_put(part1)).ok
    assert service.pending[5].missing() == [0]
    assert (await service.handle_has(BlockHas([5]))).present == [False]
    assert (await service.handle_put(part0)).ok  # now both are in: committed
    assert (await service.handle_get(BlockGet(5, 1))) == BlockPart(5, True, 1, 2, "raw", 2, checksum(b"ab"), b"ab")
    assert not (await service.handle_get(BlockGet(5, 2))).found

    big = bytes((1 << 20) + 1)
    ack = await service.handle_put(BlockPut(6, 0, 1, "raw", len(big), checksum(big), big))
    assert not ack.ok and "exceeds the capacity" in ack.error
    assert [(s, m.kind, m.seq) for s, m in bus.published if isinstance(m, KvEvent)] == [
        ("fake.kv.events.cache-store.c", "stored", 0)
    ]


async def test_a_put_lives_while_its_parts_keep_coming_and_duplicates_are_told_apart() -> None:
    now = [0.0]
    settings = load_settings("cache-store", environ={"TSUKIMI_INSTANCE_ID": "c"})
    service = CacheStoreService(settings, FakeBus(), clock=lambda: now[0])  # type: ignore[arg-type]
    parts = [BlockPut(8, i, 3, "raw", 2, checksum(b"ab"), b"ab") for i in range(3)]
    assert (await service.handle_put(parts[0])).ok
    now[0] = 25.0
    assert (await service.handle_put(parts[1])).ok
    assert (await service.handle_put(parts[1])).ok  # an identical duplicate: acknowledged, nothing new
    assert (await service.handle_put(dataclasses.replace(parts[0], replace=True))).ok  # so is one asking to replace
    now[0] = 50.0  # 50 s since the first part, 25 since the last: still coming
    assert (await service.handle_put(parts[2])).ok
    assert service.store.holds(8) and not service.pending
    assert (await service.handle_get(BlockGet(8, 0))) == BlockPart(8, True, 0, 3, "raw", 2, checksum(b"ab"), b"ab")

    assert (await service.handle_put(BlockPut(9, 0, 2, "raw", 2, checksum(b"ab"), b"ab"))).ok
    ack = await service.handle_put(BlockPut(9, 0, 2, "raw", 2, checksum(b"cd"), b"cd"))
    assert not ack.ok and "different contents" in ack.error and not service.pending  # the whole put is dropped
    ack = await service.handle_put(BlockPut(10, 0, 1, "raw", 3, checksum(b"ab"), b"ab"))
    assert not ack.ok and "2 raw bytes, expected 3" in ack.error and not service.store.holds(10)


async def test_big_changes_are_announced_in_bounded_events_and_stats_flatten_for_the_log() -> None:
    settings = load_settings("cache-store", environ={"TSUKIMI_INSTANCE_ID": "c"})
    bus = FakeBus()
    service = CacheStoreService(settings, bus)  # type: ignore[arg-type]
    service._record("stored", list(range(2 * MAX_EVENT_HASHES + 1)))  # a restart re-announcing a big SSD tier
    service._record("cleared", [])
    await service.publish_events()
    events = [m for _, m in bus.published if isinstance(m, KvEvent)]
    assert [(e.seq, e.kind, len(e.block_hashes)) for e in events] == [
        (0, "stored", MAX_EVENT_HASHES), (1, "stored", MAX_EVENT_HASHES), (2, "stored", 1), (3, "cleared", 0)
    ]
    fields = stats_fields(service.stats())
    assert fields["num_blocks"] == 0 and fields["dram_capacity_bytes"] == 1 << 30 and "dram_get_mean_ms" in fields
    assert not any(k.startswith("ssd_") for k in fields) and all(isinstance(v, int | float) for v in fields.values())
