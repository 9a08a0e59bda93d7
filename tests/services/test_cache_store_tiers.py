"""The cache-store's SSD tier, restarts, snapshots and replicas against a real nats-server: DRAM evictions land on SSD
and are served, a restarted store serves its SSD blocks in a new epoch that its events and snapshot announce, a corrupt
file is a removed miss, snapshots agree with events, and the client falls back to the replica shard. Also the real
`python -m services.cache_store` process restarted on the same folder."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_cache_store import REPO, Stack, until

from services.cache_store.service import CacheStoreService
from shared.wire.bus import Bus
from shared.wire.cache_client import CacheClient
from shared.wire.protocol import BlockHas, BlockHasReply, KvEvent, Message, Snapshot, SnapshotRequest

BLOCK_BYTES = 300_000  # incompressible: a 1 MiB DRAM holds 3; a 4th put evicts the 2 least recently used


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    stack = Stack(nats_url)
    yield stack
    await stack.close()


def block(h: int) -> bytes:
    return random.Random(h).randbytes(BLOCK_BYTES)


def kv_events(received: list[Message], epoch: int | None = None) -> list[tuple[int, str, list[int]]]:
    return [(e.seq, e.kind, e.block_hashes) for e in received
            if isinstance(e, KvEvent) and (epoch is None or e.epoch == epoch)]


async def ssd_store(stack: Stack, folder: Path, instance: str = "cache-0") -> CacheStoreService:
    return await stack.store(dram_mb=1, env={"TSUKIMI_CACHE_SSD_DIR": str(folder), "TSUKIMI_INSTANCE_ID": instance})


async def put_hot_then_push_out(client: CacheClient, hot: list[int], cold: list[int]) -> None:
    """Put `hot` and read each once (seen twice: admitted to SSD), then put `cold` to push them out of DRAM."""
    for h in hot:
        assert await client.put_block(h, block(h))
        assert await client.get_block(h) == block(h)
    for h in cold:
        assert await client.put_block(h, block(h))


async def snapshot_of(bus: Bus, instance: str) -> Snapshot:
    return await bus.request(bus.subjects.snapshot("cache-store", instance), SnapshotRequest(instance), Snapshot)


async def test_a_block_evicted_from_dram_lands_on_ssd_and_is_still_served(stack: Stack, tmp_path: Path) -> None:
    service = await ssd_store(stack, tmp_path)
    events = await stack.listen(stack.subjects.kv_events("cache-store", "cache-0"))
    client = await stack.client()
    await put_hot_then_push_out(client, hot=[1], cold=[2, 3, 4])  # 4 evicts 1 (hot: to SSD) and 2 (cold: dropped)
    await service.store.flush()
    assert service.store.ssd is not None and service.store.ssd.hashes() == [1]
    assert not service.store.dram.has(1) and (tmp_path / f"{1:016x}.kvb").is_file()
    assert await client.get_block(1) == block(1)
    assert await client.has_blocks([1, 2, 3, 4]) == [True, False, True, True]
    await until(lambda: len(events) == 5)
    assert kv_events(events) == [(1, "stored", [1]), (2, "stored", [2]), (3, "stored", [3]),
                                 (4, "removed", [2]), (5, "stored", [4])]  # moving 1 to SSD is no removal
    stats = service.stats()
    assert stats.ssd is not None and stats.ssd.hits == 1 and stats.num_admitted == 1 and stats.num_blocks == 3
    assert service.load().kv_blocks_used == 3


async def test_a_restarted_store_serves_its_ssd_blocks_in_a_new_epoch(stack: Stack, tmp_path: Path) -> None:
    first = await ssd_store(stack, tmp_path)
    events = await stack.listen(stack.subjects.kv_events("cache-store", "cache-0"))
    client, bus = await stack.client(), await stack.bus()
    await put_hot_then_push_out(client, hot=[1, 2], cold=[3, 4])
    await stack.stop(first)  # finishes the SSD writes; its DRAM (3, 4) is lost
    second = await ssd_store(stack, tmp_path)
    assert second.heartbeat.epoch != first.heartbeat.epoch

    await until(lambda: len(kv_events(events, second.heartbeat.epoch)) == 2)
    assert kv_events(events, first.heartbeat.epoch)[-1][1] == "cleared"
    restarted = kv_events(events, second.heartbeat.epoch)
    assert restarted[0] == (0, "cleared", []) and restarted[1][:2] == (1, "stored")
    assert sorted(restarted[1][2]) == [1, 2]
    snapshot = await snapshot_of(bus, "cache-0")
    assert (snapshot.epoch, snapshot.seq, sorted(snapshot.block_hashes)) == (second.heartbeat.epoch, 1, [1, 2])
    assert [await client.get_block(h) for h in (1, 2, 3)] == [block(1), block(2), None]


async def test_a_corrupt_ssd_file_is_a_miss_removed_and_announced(stack: Stack, tmp_path: Path) -> None:
    service = await ssd_store(stack, tmp_path)
    events = await stack.listen(stack.subjects.kv_events("cache-store", "cache-0"))
    client = await stack.client()
    await put_hot_then_push_out(client, hot=[1], cold=[2, 3, 4])
    await service.store.flush()
    path = tmp_path / f"{1:016x}.kvb"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    assert await client.get_block(1) is None
    assert not path.exists() and await client.has_blocks([1]) == [False]
    await until(lambda: kv_events(events)[-1:] == [(6, "removed", [1])])
    assert service.stats().num_corrupt == 1


async def test_snapshot_agrees_with_the_events_before_it(stack: Stack, tmp_path: Path) -> None:
    service = await ssd_store(stack, tmp_path)
    events = await stack.listen(stack.subjects.kv_events("cache-store", "cache-0"))
    client, bus = await stack.client(), await stack.bus()
    await put_hot_then_push_out(client, hot=[1, 2], cold=[3, 4, 5, 6])
    await service.store.flush()
    snapshot = await snapshot_of(bus, "cache-0")
    await until(lambda: len(events) == snapshot.seq)  # every event but seq 0 (sent before we listened)
    held: set[int] = set()
    for _, kind, hashes in kv_events(events):
        held = held | set(hashes) if kind == "stored" else held - set(hashes)
    assert held == set(snapshot.block_hashes) == set(service.store.hashes())
    assert {1, 2} <= held and snapshot.seq == service.events.next_seq - 1


async def test_the_client_falls_back_to_the_replica_shard(stack: Stack) -> None:
    shards = [await stack.store(shard=i, num_shards=2) for i in range(2)]
    client = await stack.client(num_shards=2, timeout_s=0.5)
    assert await client.put_block(10, b"ten" * 1000, replicas=2)  # shard 0 owns 10, shard 1 is its replica
    assert await client.put_block(12, b"twelve" * 1000)  # one copy only
    assert shards[1].store.holds(10) and not shards[1].store.holds(12)
    await stack.stop(shards[0])
    assert await client.get_block(10) == b"ten" * 1000
    assert await client.get_block(12) is None
    assert await client.has_blocks([10, 12]) == [True, False]
    assert await client.longest_prefix([10, 12]) == 1


async def test_a_hot_block_is_copied_to_its_replica_shard(stack: Stack) -> None:
    shards = [await stack.store(shard=i, num_shards=2) for i in range(2)]
    client = await stack.client(num_shards=2, hot_gets=3)
    assert await client.put_block(7, b"seven" * 1000)  # shard 1 owns 7, shard 0 is its replica
    for _ in range(2):
        assert await client.get_block(7) == b"seven" * 1000
    await client.flush()
    assert not shards[0].store.holds(7)
    assert await client.get_block(7) == b"seven" * 1000  # the third fetch makes it hot
    await client.flush()
    assert shards[0].store.holds(7)
    await stack.stop(shards[1])
    assert await client.get_block(7) == b"seven" * 1000


async def test_restarting_the_service_process_serves_its_ssd_blocks_again(stack: Stack, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSUKIMI_")}
    env.update(TSUKIMI_NATS_URL=stack.nats_url, TSUKIMI_SUBJECT_PREFIX=stack.prefix, TSUKIMI_INSTANCE_ID="proc",
               TSUKIMI_CACHE_SSD_DIR=str(tmp_path), TSUKIMI_CACHE_DRAM_MB="1")
    events = await stack.listen(stack.subjects.kv_events("cache-store", "proc"))
    bus, client = await stack.bus(), await stack.client()
    epochs = []
    for run in range(2):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cache_store", cwd=REPO, env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        try:
            await asyncio.wait_for(_answered(bus), timeout=15)
            await until(lambda: any(isinstance(e, KvEvent) and e.epoch not in epochs for e in events))
            epochs.append(next(e.epoch for e in events if isinstance(e, KvEvent) and e.epoch not in epochs))
            if run == 0:
                assert await client.has_blocks([1]) == [False]
                await put_hot_then_push_out(client, hot=[1, 2], cold=[3, 4])
            else:
                assert [await client.get_block(h) for h in (1, 2, 3)] == [block(1), block(2), None]
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), timeout=15)
            assert proc.returncode == 0, stderr.decode()[-2000:]
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    await until(lambda: kv_events(events, epochs[1])[-1:] == [(2, "cleared", [])])
    assert [kind for _, kind, _ in kv_events(events, epochs[0])] == ["cleared", *["stored"] * 4, "cleared"]
    restarted = kv_events(events, epochs[1])
    assert restarted[0] == (0, "cleared", []) and restarted[1][1] == "stored" and sorted(restarted[1][2]) == [1, 2]


async def _answered(bus: Bus) -> None:
    while True:
        try:
            await bus.request(bus.subjects.cache_has(0), BlockHas([5]), BlockHasReply, timeout_s=0.5)
            return
        except Exception:
            await asyncio.sleep(0.1)
