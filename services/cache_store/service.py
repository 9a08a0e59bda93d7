"""The cache-store service (`python -m services.cache_store`): one shard of the KV block pool.

It owns two-phase puts, serving parts as stored, KV events (stored / removed / cleared with epoch and seq), snapshots,
heartbeats and the stats log. Where blocks live (DRAM, SSD) is `services.cache_store.tiers.tiers`; the caller's side is
`shared.wire.cache_client`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import nats.errors
from nats.aio.subscription import Subscription

from services.cache_store.tiers.block import StoredBlock, part_size
from services.cache_store.tiers.dram import DramTier
from services.cache_store.tiers.ssd import SsdTier
from services.cache_store.tiers.tiers import CacheStats, TieredStore
from services.common.tasks import BackgroundTasks
from shared.config import CacheStoreSettings, ConfigError
from shared.wire.bus import Bus
from shared.wire.cache_client import block_shuffle_width
from shared.wire.heartbeat import HeartbeatSender, Load
from shared.wire.kv_events import CLEARED, STORED, KvEventLog, KvEventPublisher
from shared.wire.log import get_logger
from shared.wire.parts import PartAssembly, PartError
from shared.wire.payload import CODEC_SIZE_ONLY
from shared.wire.protocol import (
    Ack,
    BlockGet,
    BlockHas,
    BlockHasReply,
    BlockPart,
    BlockPut,
    Role,
    Snapshot,
    SnapshotRequest,
)

log = get_logger(__name__)

PENDING_TIMEOUT_S = 30.0  # a put with no new part for this long is dropped
STATS_LOG_S = 30.0  # a "cache stats" log line this often


class CacheStoreService:
    """One cache-store shard: answers `cache.<shard>.put/get/has` and `snapshot.<instance>`, emits `KvEvent`s.

    Every epoch (process start) begins with seq 0 `cleared`, then, when the SSD tier was re-indexed with blocks,
    `stored` with those hashes; then one `stored` per commit and `removed` for blocks gone from every tier (a move
    from DRAM to SSD is neither). `stop()` ends with `cleared`.

    Args:
        settings: uses `cache_shard`, `cache_dram_bytes`, `cache_ssd_dir`, `cache_ssd_bytes`, `instance_id`,
            `heartbeat_s`.
        bus: the connection (only `serve`, `publish` and `subjects` are used).
        clock: monotonic seconds, for expiring pending puts and read leases (tests pass their own).
    """

    def __init__(self, settings: CacheStoreSettings, bus: Bus, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.bus, self.clock = settings, bus, clock
        self.shard = settings.cache_shard
        ssd = SsdTier(Path(settings.cache_ssd_dir), settings.cache_ssd_bytes) if settings.cache_ssd_dir else None
        self.store = TieredStore(
            DramTier(settings.cache_dram_bytes), ssd, self._record, clock, settings.cache_ssd_admit_seen
        )
        self.pending: dict[int, PartAssembly[BlockPut]] = {}  # block hash -> the verified parts of its put (phase one)
        self.heartbeat = HeartbeatSender(
            bus, settings.instance_id, Role.CACHE_STORE.value, settings.heartbeat_s, self.load
        )
        self.events = KvEventLog(settings.instance_id, self.heartbeat.epoch, Role.CACHE_STORE)
        events_subject = bus.subjects.kv_events(Role.CACHE_STORE, settings.instance_id)
        self._events_out = KvEventPublisher(bus, self.events, events_subject)
        self.tasks = BackgroundTasks()  # event publishes
        self._stats_logger: asyncio.Task[None] | None = None
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        """Serve snapshots, re-index the SSD tier, announce the new epoch (`cleared`, then `stored` of what SSD
        holds), then serve puts, gets and probes.

        Raises:
            ConfigError: the SSD folder cannot be used (unwritable, or locked by another cache-store).
        """
        subjects = self.bus.subjects
        me = self.settings.instance_id  # snapshots first: a listener that missed seq 0 can resync
        snapshot_subject = subjects.snapshot(Role.CACHE_STORE, me)
        snapshots = await self.bus.route(snapshot_subject, {SnapshotRequest: self.handle_snapshot})
        self._subscriptions.append(snapshots)
        try:
            reindexed = await self.store.open()
        except OSError as exc:
            raise ConfigError(f"TSUKIMI_CACHE_SSD_DIR={self.settings.cache_ssd_dir}: {exc}") from None
        self._record(CLEARED, [])
        self._record(STORED, reindexed)
        await self.publish_events()
        self._subscriptions += [
            await self.bus.route(subjects.cache_put(self.shard), {BlockPut: self.handle_put}),
            await self.bus.route(subjects.cache_get(self.shard), {BlockGet: self.handle_get}),
            await self.bus.route(subjects.cache_has(self.shard), {BlockHas: self.handle_has}),
        ]
        self.heartbeat.start()
        self._stats_logger = asyncio.create_task(self._log_stats(), name="cache-stats")
        log.info(
            "serving cache shard", shard=self.shard, dram_bytes=self.store.dram.capacity_bytes,
            ssd_dir=self.settings.cache_ssd_dir, ssd_blocks=len(reindexed),
        )

    async def stop(self) -> None:
        """Finish the requests in flight and the queued SSD writes, stop beating, and announce `cleared`."""
        for sub in self._subscriptions:
            try:
                await sub.drain()
            except nats.errors.Error as exc:
                log.warning("subscription drain failed", subject=sub.subject, error=str(exc))
        self._subscriptions.clear()
        await self.heartbeat.stop()
        if self._stats_logger is not None:
            self._stats_logger.cancel()
            await asyncio.gather(self._stats_logger, return_exceptions=True)
        self.pending.clear()
        await self.store.close()
        self._record(CLEARED, [])
        await self.publish_events()  # after any flush in progress: every event out, `cleared` last
        await self.tasks.close()

    def load(self) -> Load:
        dram = self.store.dram
        return Load(kv_blocks_used=self.store.num_blocks, kv_blocks_total=0, kv_stored_bytes=dram.num_bytes,
                    kv_stored_blocks=dram.num_blocks)

    def stats(self) -> CacheStats:
        """Per-tier hits, misses, evictions, blocks, bytes and get latency, and the admission and corruption counts."""
        return self.store.stats()

    async def handle_put(self, msg: BlockPut) -> Ack:
        """Phase one: buffer a verified part as it came; phase two: commit the block once all its parts are in.

        A block already stored is acknowledged without work (part 0 of it counts as a sighting for SSD admission).
        A bad part (checksum, seq, a total that disagrees with earlier parts, a conflicting duplicate, an unknown codec
        or raw bytes of another size than stated) is refused and drops the whole pending block; so is a block too
        large to store, or one that finds no room. An identical duplicate is acknowledged.
        """
        self._drop_stale_pending()
        if msg.replace and msg.seq == 0 and self.store.holds(msg.block_hash):
            if self.store.remove(msg.block_hash):  # a reader refused our copy: the writer's new one replaces it
                log.info("replacing a block a reader refused", block_hash=msg.block_hash)
                await self.publish_events()
        if self.store.holds(msg.block_hash):
            if msg.seq == 0:
                self.store.seen.add(msg.block_hash)
            return Ack()
        error = self._buffer(msg)
        if error:
            self.pending.pop(msg.block_hash, None)
            log.warning("refused a block part", block_hash=msg.block_hash, part=msg.seq, reason=error)
            return Ack(ok=False, error=error)
        pending = self.pending[msg.block_hash]
        if not pending.is_complete:
            return Ack()
        del self.pending[msg.block_hash]
        block = StoredBlock(tuple(pending.parts()))
        try:
            await self.store.put(msg.block_hash, block)
        except ValueError as exc:
            log.warning("refused a block", block_hash=msg.block_hash, reason=str(exc))
            return Ack(ok=False, error=str(exc))
        finally:
            await self.publish_events()
        return Ack()

    async def handle_get(self, msg: BlockGet) -> BlockPart:
        """Part `msg.seq` of a stored block as it was put (from DRAM, or verified from SSD), or `found=False`."""
        block = await self.store.get(msg.block_hash, msg.seq)
        await self.publish_events()  # an SSD hit may have evicted from DRAM, a corrupt file is `removed`
        if block is None or not 0 <= msg.seq < len(block.parts):
            return BlockPart(msg.block_hash, found=False, seq=msg.seq)
        p = block.parts[msg.seq]
        return BlockPart(msg.block_hash, True, p.seq, p.total, p.codec, p.raw_size, p.checksum, p.data, p.tag)

    async def handle_has(self, msg: BlockHas) -> BlockHasReply:
        """Which of the hashes are committed here, in any tier (pending puts do not count)."""
        return BlockHasReply([self.store.holds(h) for h in msg.block_hashes])

    async def handle_snapshot(self, msg: SnapshotRequest) -> Snapshot:
        """Every hash held in any tier, as of the last event recorded (events after `seq` apply on top)."""
        return await self._events_out.snapshot()

    async def publish_events(self) -> None:
        """Publish the recorded events in order; a lost one shows as a gap in `seq`, which makes listeners resync."""
        await self._events_out.flush()

    def _record(self, kind: str, block_hashes: list[int]) -> None:
        """The tiers' hook: record the change, and publish it soon, in order."""
        self.events.record(kind, block_hashes)
        self.tasks.spawn(self._events_out.flush(), "kv-events")

    def _buffer(self, msg: BlockPut) -> str:
        """Verify the part and keep it, as it came, in its block's pending put; why it cannot be, or "" when it is
        kept (or an identical duplicate of a kept one)."""
        error = self._check_part(msg)
        if error:
            return error
        try:
            pending = self.pending.get(msg.block_hash) or self._open_put(msg)
            pending.add(replace(msg, replace=False) if msg.replace else msg)  # `replace` is an instruction, not data
        except PartError as exc:
            return str(exc)
        return ""

    def _open_put(self, msg: BlockPut) -> PartAssembly[BlockPut]:
        """The pending put of the block whose first part (to arrive) is `msg`."""
        pending: PartAssembly[BlockPut] = PartAssembly(
            f"block {msg.block_hash:#x}", msg.total, lambda part: {"block_hash": part.block_hash}, block_shuffle_width,
            PENDING_TIMEOUT_S, decode=False, clock=self.clock,
        )
        self.pending[msg.block_hash] = pending
        return pending

    def _check_part(self, msg: BlockPut) -> str:
        """Why the store will not buffer this part whatever it holds (a size-only part with bytes, no room), or ""."""
        if msg.codec == CODEC_SIZE_ONLY and msg.data:
            return f"size-only part {msg.seq} carries {len(msg.data)} bytes"
        pending = self.pending.get(msg.block_hash)
        capacity = self.store.dram.capacity_bytes
        if (_counted_bytes(pending) if pending else 0) + part_size(msg) > capacity:
            return f"block {msg.block_hash:#x} exceeds the capacity of {capacity} bytes"
        if sum(_counted_bytes(p) for p in self.pending.values()) + part_size(msg) > capacity:
            return "too many bytes in unfinished puts"
        return ""

    def _drop_stale_pending(self) -> None:
        """Drop the puts with no new part for `PENDING_TIMEOUT_S` (counted from the last part, not the first: a put
        that is slow but still coming is kept)."""
        for block_hash in [h for h, p in self.pending.items() if p.is_expired()]:
            pending = self.pending.pop(block_hash)
            log.warning("dropped an unfinished put", block_hash=block_hash, parts=pending.num_received)

    async def _log_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_LOG_S)
            log.info("cache stats", **stats_fields(self.stats()))


def _counted_bytes(pending: PartAssembly[BlockPut]) -> int:
    """What the parts of a pending put count for in DRAM (`part_size`: a size-only part, the size it stands for)."""
    return sum(part.raw_size if part.codec == CODEC_SIZE_ONLY else len(data) for part, data in pending.pieces())


def stats_fields(stats: CacheStats) -> dict[str, int | float]:
    """The stats as flat log fields: `num_blocks`, ..., then `dram_hits`, ..., `ssd_get_mean_ms` (no SSD: none)."""
    fields: dict[str, int | float] = {k: v for k, v in asdict(stats).items() if not isinstance(v, dict | None)}
    for name, tier in (("dram", stats.dram), ("ssd", stats.ssd)):
        if tier is not None:
            fields.update({f"{name}_{k}": v for k, v in asdict(tier).items()})
    return fields
