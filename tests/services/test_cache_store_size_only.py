"""Size-only blocks (the sim engine's KV) through a real cache-store and nats-server: they allocate nothing but count
their declared size against DRAM (stats, eviction, refusal), come back as sizes, and fill a meta pool's PrefixLoad."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cache_stack import Stack

from services.cache_store.tiers.block import StoredBlock, part_size
from services.cache_store.tiers.ssd import SsdTier
from shared.engine.blocks import BlockManager
from shared.engine.kv.prefix_load import PrefixLoad
from shared.engine.kv.sized import SizedKvStore
from shared.model.config import LlamaConfig
from shared.wire.bus import BusError
from shared.wire.cache_client import CacheClient, split_block
from shared.wire.payload import CODEC_SIZE_ONLY, Payload, SizeOnly, checksum
from shared.wire.protocol import Ack, BlockPut

GIB = 1 << 30
DRAM_MB = 64 << 10  # 64 GiB of declared capacity; size-only blocks allocate none of it
MODEL = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    head_dim=8, rope_theta=1e4, rms_norm_eps=1e-5, max_position=1024, tie_word_embeddings=False)
BLOCK = 16
LAYER_BYTES = 2 * 2 * BLOCK * 8 * 2  # K and V x kv heads x block tokens x head dim x bf16
BLOCK_BYTES = MODEL.num_layers * LAYER_BYTES


@pytest.fixture
async def cluster(nats_url: str) -> AsyncIterator[Stack]:
    cluster = Stack(nats_url)
    yield cluster
    await cluster.close()


async def all_parts(client: CacheClient, block_hash: int) -> list[Payload]:
    return [part async for part in client.get_block_parts(block_hash)]


def test_a_size_only_block_is_one_size_only_part_that_counts_its_size() -> None:
    (part,) = split_block(5, SizeOnly(10 * GIB), part_bytes=256 << 10)
    assert (part.codec, part.raw_size, part.data, part.total) == (CODEC_SIZE_ONLY, 10 * GIB, b"", 1)
    assert part.checksum == checksum(b"")
    assert part_size(part) == 10 * GIB
    real = split_block(6, b"x" * 1000, part_bytes=400)
    assert len(StoredBlock((part, *real))) == 10 * GIB + sum(len(p.data) for p in real)


async def test_a_size_only_block_round_trips_and_counts_its_declared_size(cluster: Stack) -> None:
    service = await cluster.store(dram_mb=DRAM_MB)
    client = await cluster.client()
    assert await client.put_block(0xABC, SizeOnly(10 * GIB))
    assert await client.get_block(0xABC) == SizeOnly(10 * GIB)
    assert await all_parts(client, 0xABC) == [SizeOnly(10 * GIB)]
    assert await client.has_blocks([0xABC]) == [True]
    stats = service.stats()
    assert (stats.dram.num_blocks, stats.dram.num_bytes, stats.dram.capacity_bytes) == (1, 10 * GIB, 64 * GIB)
    assert await client.put_block(0xABD, b"real bytes" * 100)  # real blocks share the same count
    assert service.stats().dram.num_bytes == 10 * GIB + len(service.store.dram.get(0xABD) or ())


async def test_a_size_only_block_larger_than_dram_is_refused(cluster: Stack) -> None:
    service = await cluster.store(dram_mb=DRAM_MB)
    client = await cluster.client()
    assert not await client.put_block(0xB16, SizeOnly(65 * GIB))
    assert await client.has_blocks([0xB16]) == [False] and await client.get_block(0xB16) is None
    assert service.stats().dram.num_bytes == 0 and not service.pending


async def test_size_only_blocks_evict_by_their_declared_size(cluster: Stack) -> None:
    service = await cluster.store(dram_mb=DRAM_MB)
    client = await cluster.client()
    for h in range(1, 8):  # 70 GiB declared into 64: past the 95% watermark, evicted down to 85%
        assert await client.put_block(h, SizeOnly(10 * GIB))
    stats = service.stats()
    assert (stats.dram.num_blocks, stats.dram.num_bytes, stats.dram.evictions) == (5, 50 * GIB, 2)
    assert await client.has_blocks(list(range(1, 8))) == [False, False, True, True, True, True, True]
    assert await client.get_block(7) == SizeOnly(10 * GIB)


async def test_a_hot_size_only_block_is_copied_to_its_replica_as_a_size(cluster: Stack) -> None:
    shards = [await cluster.store(shard=i, num_shards=2, dram_mb=DRAM_MB) for i in range(2)]
    client = await cluster.client(num_shards=2, hot_gets=1)
    assert await client.put_block(4, SizeOnly(3 * GIB))  # owner: shard 0, replica: shard 1
    assert not shards[1].store.holds(4)
    assert await client.get_block(4) == SizeOnly(3 * GIB)
    await client.flush()
    assert shards[1].store.holds(4) and shards[1].stats().dram.num_bytes == 3 * GIB


async def test_a_size_only_part_carrying_data_is_refused(cluster: Stack) -> None:
    service = await cluster.store(dram_mb=DRAM_MB)
    bus = await cluster.bus()
    data = b"x" * 100_000
    part = BlockPut(0xD1, 0, 1, CODEC_SIZE_ONLY, 4, checksum(data), data)  # claims 4 bytes, carries 100 KB
    with pytest.raises(BusError):
        await bus.request(cluster.subjects.cache_put(0), part, Ack)
    assert not service.store.holds(0xD1)


async def test_a_size_only_block_on_ssd_counts_the_same_after_a_restart(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path, 100 * GIB, durable=False)
    ssd.open()
    await ssd.put(9, StoredBlock(tuple(split_block(9, SizeOnly(10 * GIB), 256 << 10))), lambda h: False)
    running = ssd.num_bytes
    assert running > 10 * GIB
    block = await ssd.get(9)
    assert block is not None and len(block) == 10 * GIB
    ssd.close()
    reopened = SsdTier(tmp_path, 100 * GIB, durable=False)
    report = reopened.open()
    reopened.close()
    assert report.num_blocks == 1
    assert reopened.num_bytes == running


def sized_store(num_blocks: int = 4) -> SizedKvStore:
    return SizedKvStore(MODEL, BlockManager(num_blocks, BLOCK), "bf16", max_num_seqs=4)


async def test_a_size_only_block_from_the_store_completes_a_prefix_load(cluster: Stack) -> None:
    await cluster.store(dram_mb=DRAM_MB)
    client = await cluster.client()
    pool = sized_store()
    assert pool.block_footprint == BLOCK_BYTES and isinstance(pool.block_payload(0, True), SizeOnly)
    assert await client.put_block(21, SizeOnly(BLOCK_BYTES))
    load = PrefixLoad(pool, [2])
    assert load.block_sizes == [BLOCK_BYTES]
    async for part in client.get_block_parts(21):
        assert load.write(0, part)
    assert load.is_complete and load.num_ready_layers == MODEL.num_layers and load.error is None
    assert load.wait_layer(MODEL.num_layers - 1)


def test_size_only_pieces_make_layers_ready_by_count() -> None:
    load = PrefixLoad(sized_store(), [0, 3])
    assert load.write(0, SizeOnly(BLOCK_BYTES))
    assert load.num_ready_layers == 0  # block 1 has nothing yet
    assert load.write(1, SizeOnly(2 * LAYER_BYTES))
    assert load.num_ready_layers == 2 and load.is_layer_ready(1) and not load.is_layer_ready(2)
    assert load.write(1, SizeOnly(2 * LAYER_BYTES))
    assert load.is_complete


def test_a_size_only_piece_larger_than_the_block_fails_the_load() -> None:
    load = PrefixLoad(sized_store(), [1])
    assert not load.write(0, SizeOnly(BLOCK_BYTES + LAYER_BYTES))
    assert load.error is not None and "more than" in load.error and not load.is_complete
    assert not load.write(0, SizeOnly(BLOCK_BYTES))  # a failed load takes no more writes
