"""The cache-store client: put, get and probe KV blocks on the shard that owns each hash, in verified parts.

It never raises for a dead, absent or misbehaving store: that is a miss (or a failed put), logged. It does not
know what the bytes mean; the caller encodes KV into them.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import TypeVar

import nats.errors

from shared.bus import Bus, BusError
from shared.kv_wire import KvTransferError, checksum, compress, decompress
from shared.log import get_logger
from shared.protocol import Ack, BlockGet, BlockHas, BlockHasReply, BlockPart, BlockPut, Message

log = get_logger(__name__)
T = TypeVar("T", bound=Message)

_ENVELOPE_BYTES = 4096  # room for the msgpack envelope and NATS headers around a part's data
# Blocks carry no dtype, so parts are byte-shuffled with one fixed element width that every client agrees on; a width
# of 4 groups the exponent bytes of fp32 and of fp16/bf16 alike. A part whose size is not a multiple uses width 1.
SHUFFLE_ITEMSIZE = 4


def _itemsize(raw_size: int) -> int:
    return SHUFFLE_ITEMSIZE if raw_size % SHUFFLE_ITEMSIZE == 0 else 1


def split_block(block_hash: int, data: bytes, part_bytes: int) -> list[BlockPut]:
    """The block as `BlockPut` parts, each carrying at most `part_bytes` of data (at least one part)."""
    chunks = [data[i : i + part_bytes] for i in range(0, len(data), part_bytes)] or [b""]
    parts = []
    for index, raw in enumerate(chunks):
        codec, payload = compress(raw, _itemsize(len(raw)))
        parts.append(BlockPut(block_hash, index, len(chunks), codec, len(raw), checksum(payload), payload))
    return parts


# ---- the client ----------------------------------------------------------------------------------------------


class CacheClient:
    """Talks to the cache-store shards (`cache.<shard>.put/get/has`); block `h` lives on shard `h % num_shards`.

    Args:
        bus: the connection.
        num_shards: how many cache-store shards there are (`TSUKIMI_CACHE_SHARDS`).
        part_bytes: the most data bytes per message (also capped below the server's max payload).
        timeout_s: how long one request waits before the store counts as absent.
    Raises:
        ValueError: `num_shards` or `part_bytes` below 1.
    """

    def __init__(self, bus: Bus, num_shards: int, part_bytes: int = 256 << 10, timeout_s: float = 2.0) -> None:
        if num_shards < 1 or part_bytes < 1:
            raise ValueError(f"num_shards and part_bytes must be at least 1, got {num_shards}, {part_bytes}")
        self.bus, self.num_shards, self.part_bytes, self.timeout_s = bus, num_shards, part_bytes, timeout_s

    def shard_of(self, block_hash: int) -> int:
        return block_hash % self.num_shards

    async def put_block(self, block_hash: int, data: bytes) -> bool:
        """Store one block; True once every part was acknowledged (the store then commits it).

        A block the store already holds is acknowledged at once. False (logged) when any part fails.
        """
        part_bytes = max(1, min(self.part_bytes, self.bus.max_payload - _ENVELOPE_BYTES))
        subject = self.bus.subjects.cache_put(self.shard_of(block_hash))
        parts = split_block(block_hash, data, part_bytes)
        acks = await asyncio.gather(*(self._ask(subject, part, Ack) for part in parts))
        return all(ack is not None for ack in acks)

    async def get_block(self, block_hash: int) -> bytes | None:
        """The block's bytes, or None when the store lacks it, is absent, or sends a missing or corrupt part."""
        first = await self._get_part(block_hash, 0)
        if first is None:
            return None
        rest = await asyncio.gather(*(self._get_part(block_hash, i) for i in range(1, first.num_parts)))
        raws: list[bytes] = []
        for index, part in enumerate([first, *rest]):
            raw = self._verified(block_hash, index, first.num_parts, part)
            if raw is None:
                return None
            raws.append(raw)
        return b"".join(raws)

    async def has_blocks(self, hashes: list[int]) -> list[bool]:
        """Which of `hashes` are stored: one request per shard; an absent shard holds nothing."""
        by_shard: dict[int, list[int]] = defaultdict(list)
        for h in hashes:
            by_shard[self.shard_of(h)].append(h)
        shards = list(by_shard)
        replies = await asyncio.gather(*(self._has_on(shard, by_shard[shard]) for shard in shards))
        present: dict[int, bool] = {}
        for shard, reply in zip(shards, replies, strict=True):
            present.update(zip(by_shard[shard], reply, strict=True))
        return [present[h] for h in hashes]

    async def longest_prefix(self, hashes: list[int]) -> int:
        """How many leading hashes of a chain are stored (the reusable prefix, in blocks)."""
        num_present = 0
        for is_present in await self.has_blocks(hashes):
            if not is_present:
                break
            num_present += 1
        return num_present

    async def _get_part(self, block_hash: int, part: int) -> BlockPart | None:
        subject = self.bus.subjects.cache_get(self.shard_of(block_hash))
        reply = await self._ask(subject, BlockGet(block_hash, part), BlockPart)
        if reply is not None and not reply.found:
            log.debug("cache miss", block_hash=block_hash, part=part)
            return None
        return reply

    def _verified(self, block_hash: int, index: int, num_parts: int, part: BlockPart | None) -> bytes | None:
        why = ""
        if part is None:
            why = "missing part"
        elif part.block_hash != block_hash or part.part != index or not 1 <= part.num_parts == num_parts:
            why = f"part {part.part}/{part.num_parts} of {part.block_hash:#x} answered for {index}/{num_parts}"
        elif checksum(part.data) != part.checksum:
            why = "checksum mismatch"
        if why or part is None:
            log.warning("cache get refused a block", block_hash=block_hash, part=index, reason=why)
            return None
        try:
            return decompress(part.codec, part.data, part.raw_size, _itemsize(part.raw_size))
        except KvTransferError as exc:
            log.warning("cache get refused a block", block_hash=block_hash, part=index, reason=str(exc))
            return None

    async def _has_on(self, shard: int, hashes: list[int]) -> list[bool]:
        reply = await self._ask(self.bus.subjects.cache_has(shard), BlockHas(hashes), BlockHasReply)
        if reply is None:
            return [False] * len(hashes)
        if len(reply.present) != len(hashes):
            log.warning("cache has answered the wrong count", shard=shard, asked=len(hashes), got=len(reply.present))
            return [False] * len(hashes)
        return reply.present

    async def _ask(self, subject: str, msg: Message, expected: type[T]) -> T | None:
        """The typed reply, or None (logged) when the store is absent, slow, or answers an error."""
        try:
            return await self.bus.request(subject, msg, expected, self.timeout_s)
        except (BusError, nats.errors.Error) as exc:
            log.warning("cache request failed", subject=subject, kind=msg.KIND, error=str(exc))
            return None
