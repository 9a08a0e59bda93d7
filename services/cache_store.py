"""The cache-store service (`python -m services.cache_store`): one shard of the KV block pool, DRAM tier only.

It owns two-phase puts, serving parts back as stored, KV events and heartbeats; the LRU is `shared.cache.dram` and
the caller's side `shared.cache.client`. No SSD tier and no read leases yet.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import nats.errors
from nats.aio.subscription import Subscription

from shared.bus import Bus, Handler, run_service
from shared.cache.dram import DramTier
from shared.config import Settings
from shared.heartbeat import HeartbeatSender, Load
from shared.kv_wire import checksum
from shared.log import get_logger
from shared.protocol import Ack, BlockGet, BlockHas, BlockHasReply, BlockPart, BlockPut, KvEvent, Message, Role

log = get_logger(__name__)
T = TypeVar("T", bound=Message)

PENDING_TIMEOUT_S = 30.0  # a put whose parts stop arriving is dropped after this long


@dataclass(frozen=True)
class StoredBlock:
    """A committed block: its parts as they arrived, served back as they are (never recompressed)."""

    parts: tuple[BlockPut, ...]

    def __len__(self) -> int:
        return sum(len(part.data) for part in self.parts)


@dataclass
class PendingBlock:
    """The verified parts of a block still being put (phase one); committed when all `num_parts` are in."""

    num_parts: int
    started_at: float  # monotonic seconds of the first part
    parts: dict[int, BlockPut] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(len(part.data) for part in self.parts.values())


class CacheStoreService:
    """One cache-store shard: answers `cache.<shard>.put/get/has`, emits `KvEvent`s, sends heartbeats.

    Args:
        settings: uses `cache_shard`, `cache_dram_bytes`, `instance_id`, `heartbeat_s`.
        bus: the connection (only `serve`, `publish` and `subjects` are used).
        clock: monotonic seconds, for expiring pending puts (tests pass their own).
    """

    def __init__(self, settings: Settings, bus: Bus, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.bus, self.clock = settings, bus, clock
        self.shard = settings.cache_shard
        self.dram: DramTier[StoredBlock] = DramTier(settings.cache_dram_bytes)
        self.pending: dict[int, PendingBlock] = {}
        self.heartbeat = HeartbeatSender(
            bus, settings.instance_id, Role.CACHE_STORE.value, settings.heartbeat_s, self.load
        )
        self.next_seq = 0  # of the next KvEvent in this epoch
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        subjects = self.bus.subjects
        routes: list[tuple[str, Handler]] = [
            (subjects.cache_put(self.shard), _typed(BlockPut, self.handle_put)),
            (subjects.cache_get(self.shard), _typed(BlockGet, self.handle_get)),
            (subjects.cache_has(self.shard), _typed(BlockHas, self.handle_has)),
        ]
        for subject, handler in routes:
            self._subscriptions.append(await self.bus.serve(subject, handler))
        self.heartbeat.start()
        log.info("serving cache shard", shard=self.shard, dram_bytes=self.dram.capacity_bytes)

    async def stop(self) -> None:
        """Finish the requests in flight, stop beating, and announce that this DRAM is gone (`cleared`)."""
        for sub in self._subscriptions:
            try:
                await sub.drain()
            except nats.errors.Error as exc:
                log.warning("subscription drain failed", subject=sub.subject, error=str(exc))
        self._subscriptions.clear()
        await self.heartbeat.stop()
        self.pending.clear()
        self.dram.clear()
        await self._emit("cleared", [])

    def load(self) -> Load:
        return Load(kv_blocks_used=self.dram.num_blocks, kv_blocks_total=0)

    async def handle_put(self, msg: BlockPut) -> Ack:
        """Phase one: buffer a verified part; phase two: commit the block once all its parts are in.

        A block already stored is acknowledged without work. A bad part (checksum, indices, a part count that
        disagrees with earlier parts) is refused and drops the whole pending block; so is a block too large to store.
        """
        self._drop_stale_pending()
        if self.dram.has(msg.block_hash):
            return Ack()
        error = self._check_part(msg)
        if error:
            self.pending.pop(msg.block_hash, None)
            log.warning("refused a block part", block_hash=msg.block_hash, part=msg.part, reason=error)
            return Ack(ok=False, error=error)
        pending = self.pending.setdefault(msg.block_hash, PendingBlock(msg.num_parts, self.clock()))
        pending.parts[msg.part] = msg
        if len(pending.parts) < pending.num_parts:
            return Ack()
        del self.pending[msg.block_hash]
        return await self._commit(msg.block_hash, StoredBlock(tuple(pending.parts[i] for i in range(msg.num_parts))))

    async def handle_get(self, msg: BlockGet) -> BlockPart:
        """Part `msg.part` of a stored block exactly as it was put, or `found=False`."""
        block = self.dram.get(msg.block_hash)
        if block is None or not 0 <= msg.part < len(block.parts):
            return BlockPart(msg.block_hash, found=False, part=msg.part)
        p = block.parts[msg.part]
        return BlockPart(msg.block_hash, True, p.part, p.num_parts, p.codec, p.raw_size, p.checksum, p.data)

    async def handle_has(self, msg: BlockHas) -> BlockHasReply:
        """Which of the hashes are committed here (pending puts do not count)."""
        return BlockHasReply([self.dram.has(h) for h in msg.block_hashes])

    def _check_part(self, msg: BlockPut) -> str:
        """Why this part cannot be buffered, or "" when it can."""
        if not 0 <= msg.part < msg.num_parts:
            return f"part {msg.part} outside 0..{msg.num_parts - 1}"
        if checksum(msg.data) != msg.checksum:
            return f"checksum mismatch in part {msg.part}"
        pending = self.pending.get(msg.block_hash)
        if pending is not None and pending.num_parts != msg.num_parts:
            return f"part count {msg.num_parts} disagrees with earlier parts ({pending.num_parts})"
        capacity = self.dram.capacity_bytes
        if (pending.num_bytes if pending else 0) + len(msg.data) > capacity:
            return f"block {msg.block_hash:#x} exceeds the capacity of {capacity} bytes"
        if sum(p.num_bytes for p in self.pending.values()) + len(msg.data) > capacity:
            return "too many bytes in unfinished puts"
        return ""

    async def _commit(self, block_hash: int, block: StoredBlock) -> Ack:
        try:
            evicted = self.dram.put(block_hash, block)
        except ValueError as exc:
            log.warning("refused a block", block_hash=block_hash, reason=str(exc))
            return Ack(ok=False, error=str(exc))
        if evicted:
            await self._emit("removed", evicted)
        await self._emit("stored", [block_hash])
        return Ack()

    def _drop_stale_pending(self) -> None:
        now = self.clock()
        stale = [h for h, p in self.pending.items() if now - p.started_at > PENDING_TIMEOUT_S]
        for block_hash in stale:
            pending = self.pending.pop(block_hash)
            log.warning("dropped an unfinished put", block_hash=block_hash, parts=len(pending.parts))

    async def _emit(self, kind: str, block_hashes: list[int]) -> None:
        """Publish the next event; a lost one shows as a gap in `seq`, which makes listeners resync."""
        event = KvEvent(self.settings.instance_id, self.heartbeat.epoch, self.next_seq, kind, block_hashes)
        self.next_seq += 1
        try:
            await self.bus.publish(self.bus.subjects.kv_events(self.settings.instance_id), event)
        except nats.errors.Error as exc:
            log.warning("kv event lost", kind=kind, seq=event.seq, error=str(exc))


def _typed(kind: type[T], handler: Callable[[T], Awaitable[Message]]) -> Handler:
    """A bus handler that answers messages of another type with an error `Ack` instead of calling `handler`."""

    async def on_message(msg: Message) -> Message:
        if not isinstance(msg, kind):
            return Ack(ok=False, error=f"expected {kind.KIND}, got {msg.KIND}")
        return await handler(msg)

    return on_message


async def build_service(settings: Settings, bus: Bus) -> CacheStoreService:
    return CacheStoreService(settings, bus)


def main() -> None:
    """Serve the shard `TSUKIMI_CACHE_SHARD` until SIGTERM or SIGINT."""
    run_service(Role.CACHE_STORE.value, build_service)


if __name__ == "__main__":
    main()
