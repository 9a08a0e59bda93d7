"""The cache-store client: put, get and probe KV blocks on the shard that owns each hash (and its replica shard), in
verified parts, each tagged with the deployment's block key (`integrity`) and refused when its tag does not verify.
It never raises for a dead, absent or misbehaving store: that is a miss (or a failed put), logged. It does not know
what the bytes mean; the caller encodes KV into them.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, defaultdict, deque
from collections.abc import AsyncGenerator
from typing import TypeVar

import nats.errors

from shared.wire.block_integrity import BlockSigner
from shared.wire.bus import Bus, BusError
from shared.wire.log import get_logger
from shared.wire.parts import PartAssembly, PartError, cut_payload, shuffle_width
from shared.wire.payload import Payload, join
from shared.wire.protocol import Ack, BlockGet, BlockHas, BlockHasReply, BlockPart, BlockPut, Message

log = get_logger(__name__)
T = TypeVar("T", bound=Message)

_ENVELOPE_BYTES = 4096  # room for the msgpack envelope and NATS headers around a part's data
# Blocks carry no dtype, so parts are byte-shuffled with one fixed element width that every client agrees on; a width
# of 4 groups the exponent bytes of fp32 and of fp16/bf16 alike. A part whose size is not a multiple uses width 1
# (`shared.wire.parts.shuffle_width`).
SHUFFLE_ITEMSIZE = 4
HOT_GETS = 4  # a block this client fetched this often from its owner shard is copied to the replica shard
_HOT_ENTRIES = 4096  # hashes whose get counts are remembered
_REFUSED_ENTRIES = 4096  # hashes whose stored copy failed its check, to be replaced by the next put


def split_block(
    block_hash: int, data: Payload, part_bytes: int, signer: BlockSigner | None = None, replace: bool = False,
    align_bytes: int = 1,
) -> list[BlockPut]:
    """The block as `BlockPut` parts, each carrying at most `part_bytes` raw bytes (at least one part) and its tag; a
    size-only block is one size-only part. Where a unit of `align_bytes` fits in a part, parts hold whole units.
    `replace` asks the store to put these over the copy it holds."""
    signer = signer or BlockSigner(None)
    bodies = cut_payload(data, part_bytes, SHUFFLE_ITEMSIZE, align_bytes)
    total = len(bodies)
    return [
        BlockPut(block_hash, seq, total, **body.fields(),
                 tag=signer.tag(block_hash, seq, total, body.codec, body.raw_size, body.data),
                 replace=replace and seq == 0)
        for seq, body in enumerate(bodies)
    ]


def block_shuffle_width(part: BlockPut | BlockPart) -> int:
    """The width a block part's bytes are shuffled by: `SHUFFLE_ITEMSIZE`, or 1 for a part not of whole elements."""
    return shuffle_width(part.raw_size, SHUFFLE_ITEMSIZE)


def _fetch(block_hash: int, total: int) -> PartAssembly[BlockPart]:
    """Verifies and decodes one fetch of a block's `total` parts (a found `BlockPart` has at least one)."""
    return PartAssembly(
        f"block {block_hash:#x}", total, lambda part: {"block_hash": part.block_hash}, block_shuffle_width
    )


def _joined(fetch: PartAssembly[BlockPart]) -> Payload:
    return join([raw for _, raw in fetch.pieces()])


# ---- the client ----------------------------------------------------------------------------------------------


class CacheClient:
    """Talks to the cache-store shards (`cache.<shard>.put/get/has`).

    Block `h` is owned by shard `h % num_shards`; its replica shard is `(h + 1) % num_shards`. Gets and probes fall
    back to the replica when the owner misses or is down. A block is written to the replica when the caller asks for
    more than one copy, or when this client has fetched it `hot_gets` times from its owner (a hot block, copied once
    in the background).

    Args:
        bus: the connection.
        num_shards: how many cache-store shards there are (`TSUKIMI_CACHE_SHARDS`).
        part_bytes: the most data bytes per message (also capped below the server's max payload).
        timeout_s: how long one request waits before the store counts as absent.
        hot_gets: owner fetches after which a block is copied to its replica (0: never).
        signer: tags what this client puts and checks what it gets (default: no key, nothing checked).
    Raises:
        ValueError: `num_shards` or `part_bytes` below 1.
    """

    def __init__(
        self, bus: Bus, num_shards: int, part_bytes: int = 256 << 10, timeout_s: float = 2.0, hot_gets: int = HOT_GETS,
        signer: BlockSigner | None = None,
    ) -> None:
        if num_shards < 1 or part_bytes < 1:
            raise ValueError(f"num_shards and part_bytes must be at least 1, got {num_shards}, {part_bytes}")
        self.bus, self.num_shards, self.part_bytes, self.timeout_s = bus, num_shards, part_bytes, timeout_s
        self.hot_gets = hot_gets
        self.signer = signer or BlockSigner(None)
        self._refused: OrderedDict[int, None] = OrderedDict()  # stored copies that failed their check
        self._owner_gets: OrderedDict[int, int] = OrderedDict()  # hash -> fetches from its owner; -1: replicated
        self._tasks: set[asyncio.Task[None]] = set()

    def shard_of(self, block_hash: int) -> int:
        return block_hash % self.num_shards

    def replica_of(self, block_hash: int) -> int:
        return (block_hash + 1) % self.num_shards

    def shards_of(self, block_hash: int, copies: int) -> list[int]:
        """The shards that hold `copies` copies of a block: the owner, then the next ones (at most every shard)."""
        return [(block_hash + i) % self.num_shards for i in range(max(1, min(copies, self.num_shards)))]

    async def put_block(self, block_hash: int, data: Payload, replicas: int = 1, align_bytes: int = 1) -> bool:
        """Store one block on `replicas` shards (the owner first); True when at least one acknowledged every part.

        A shard that already holds the block acknowledges at once. Failures are logged. Where a unit of `align_bytes`
        fits in a part, parts hold whole units (whole layers of KV, say, so that a reader can use each part at once).
        """
        replace = block_hash in self._refused
        self._refused.pop(block_hash, None)
        parts = split_block(block_hash, data, self._part_bytes(), self.signer, replace, align_bytes)
        stored = await asyncio.gather(*(self._put_on(shard, parts) for shard in self.shards_of(block_hash, replicas)))
        return any(stored)

    async def get_block(self, block_hash: int) -> Payload | None:
        """The block's bytes from its owner, else from its replica shard; None when neither has a good copy."""
        data = await self._get_from(self.shard_of(block_hash), block_hash)
        if data is not None:
            self._count_owner_get(block_hash, data)
            return data
        if self.num_shards == 1:
            return None
        return await self._get_from(self.replica_of(block_hash), block_hash)

    async def get_block_parts(self, block_hash: int, window: int = 2) -> AsyncGenerator[Payload, None]:
        """The block's bytes part by part, in order, each verified, as they arrive (`window` parts in flight), from
        its owner, else (when the owner lacks its first part) from its replica shard.

        Stops early (logged) at a missing or corrupt part: the caller, who knows the block's size, takes a short
        block for a miss. A whole block from its owner counts towards copying a hot block, as in `get_block`.
        """
        shard = self.shard_of(block_hash)
        first = await self._get_part(shard, block_hash, 0)
        if first is None and self.num_shards > 1:
            shard = self.replica_of(block_hash)
            first = await self._get_part(shard, block_hash, 0)
        if first is None:
            return
        fetch = _fetch(block_hash, first.total)
        raw = self._verified(fetch, block_hash, 0, first)
        if raw is None:
            return
        yield raw
        in_flight: deque[tuple[int, asyncio.Task[BlockPart | None]]] = deque()
        next_seq = 1
        try:
            while next_seq < fetch.total or in_flight:
                while next_seq < fetch.total and len(in_flight) < window:
                    in_flight.append((next_seq, asyncio.ensure_future(self._get_part(shard, block_hash, next_seq))))
                    next_seq += 1
                seq, task = in_flight.popleft()
                raw = self._verified(fetch, block_hash, seq, await task)
                if raw is None:
                    return
                yield raw
        finally:
            for _, task in in_flight:
                task.cancel()
        if shard == self.shard_of(block_hash):
            self._count_owner_get(block_hash, _joined(fetch))

    async def has_blocks(self, hashes: list[int]) -> list[bool]:
        """Which of `hashes` are stored on their owner or replica shard (one request per shard and round)."""
        present = await self._has_where({h: self.shard_of(h) for h in hashes})
        missing = [h for h, is_present in present.items() if not is_present]
        if missing and self.num_shards > 1:
            present.update(await self._has_where({h: self.replica_of(h) for h in missing}))
        return [present[h] for h in hashes]

    async def longest_prefix(self, hashes: list[int]) -> int:
        """How many leading hashes of a chain are stored (the reusable prefix, in blocks)."""
        num_present = 0
        for is_present in await self.has_blocks(hashes):
            if not is_present:
                break
            num_present += 1
        return num_present

    async def flush(self) -> None:
        """Wait for the background copies of hot blocks started so far."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _part_bytes(self) -> int:
        return max(1, min(self.part_bytes, self.bus.max_payload - _ENVELOPE_BYTES))

    async def _put_on(self, shard: int, parts: list[BlockPut]) -> bool:
        subject = self.bus.subjects.cache_put(shard)
        first = []
        if parts[0].replace:  # the store drops its copy on part 0: the others must not reach it before
            first = [await self._ask(subject, parts[0], Ack)]
            parts = parts[1:]
        acks = [*first, *await asyncio.gather(*(self._ask(subject, part, Ack) for part in parts))]
        return all(ack is not None for ack in acks)

    async def _get_from(self, shard: int, block_hash: int) -> Payload | None:
        first = await self._get_part(shard, block_hash, 0)
        if first is None:
            return None
        fetch = _fetch(block_hash, first.total)
        rest = await asyncio.gather(*(self._get_part(shard, block_hash, seq) for seq in range(1, fetch.total)))
        for seq, part in enumerate([first, *rest]):
            if self._verified(fetch, block_hash, seq, part) is None:
                return None
        return _joined(fetch)

    def _count_owner_get(self, block_hash: int, data: Payload) -> None:
        """Count a fetch from the owner; at `hot_gets` copy the block to its replica shard (once)."""
        if self.num_shards == 1 or self.hot_gets < 1:
            return
        count = self._owner_gets.pop(block_hash, 0)
        if count >= 0:
            count += 1
        if count >= self.hot_gets:
            count = -1
            task = asyncio.get_running_loop().create_task(self._replicate(block_hash, data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._owner_gets[block_hash] = count
        if len(self._owner_gets) > _HOT_ENTRIES:
            self._owner_gets.popitem(last=False)

    async def _replicate(self, block_hash: int, data: Payload) -> None:
        replica = self.replica_of(block_hash)
        if (await self._has_on(replica, [block_hash]))[0]:
            return
        if await self._put_on(replica, split_block(block_hash, data, self._part_bytes(), self.signer)):
            log.info("copied a hot block to its replica shard", block_hash=block_hash, shard=replica)

    async def _get_part(self, shard: int, block_hash: int, seq: int) -> BlockPart | None:
        subject = self.bus.subjects.cache_get(shard)
        reply = await self._ask(subject, BlockGet(block_hash, seq), BlockPart)
        if reply is not None and not reply.found:
            log.debug("cache miss", block_hash=block_hash, part=seq, shard=shard)
            return None
        return reply

    def _verified(
        self, fetch: PartAssembly[BlockPart], block_hash: int, seq: int, part: BlockPart | None
    ) -> Payload | None:
        """Part `seq` of the block, verified and decoded by `fetch`; None (logged) when it is missing or refused.

        A refused part that answers for this hash marks the stored copy bad (`_refuse`)."""
        try:
            return fetch.add(self._answering(block_hash, seq, part))
        except PartError as exc:
            log.warning("cache get refused a block", block_hash=block_hash, part=seq, reason=str(exc))
            if part is not None and part.block_hash == block_hash:
                self._refuse(block_hash)
            return None

    def _answering(self, block_hash: int, seq: int, part: BlockPart | None) -> BlockPart:
        """`part`, when it is part `seq` of this block under this deployment's block key.

        Raises:
            PartError: no part, another block's or another seq's, or a tag that does not verify.
        """
        if part is None:
            raise PartError("missing part")
        if part.block_hash != block_hash or part.seq != seq:
            raise PartError(f"part {part.seq}/{part.total} of {part.block_hash:#x} answered for part {seq}")
        if not self.signer.verifies(part):
            raise PartError("tag mismatch: not put with this deployment's block key, or relabelled")
        return part

    def _refuse(self, block_hash: int) -> None:
        """Remember that the stored copy is bad: the next put of this block replaces it."""
        self._refused[block_hash] = None
        if len(self._refused) > _REFUSED_ENTRIES:
            self._refused.popitem(last=False)

    async def _has_where(self, shard_of: dict[int, int]) -> dict[int, bool]:
        """Ask each shard about the hashes mapped to it, in parallel."""
        by_shard: dict[int, list[int]] = defaultdict(list)
        for block_hash, shard in shard_of.items():
            by_shard[shard].append(block_hash)
        shards = list(by_shard)
        replies = await asyncio.gather(*(self._has_on(shard, by_shard[shard]) for shard in shards))
        present: dict[int, bool] = {}
        for shard, reply in zip(shards, replies, strict=True):
            present.update(zip(by_shard[shard], reply, strict=True))
        return present

    async def _has_on(self, shard: int, hashes: list[int]) -> list[bool]:
        reply = await self._ask(self.bus.subjects.cache_has(shard), BlockHas(hashes), BlockHasReply)
        if reply is None:
            return [False] * len(hashes)
        if len(reply.present) != len(hashes):
            log.warning("cache has answered the wrong count", shard=shard, asked=len(hashes), got=len(reply.present))
            return [False] * len(hashes)
        return reply.present

    async def _ask(self, subject: str, msg: Message, expected: type[T]) -> T | None:
        """The typed reply, or None (logged) when the store is absent, slow, or answers an error. An absent store is
        not waited for: a lookup it misses costs only a recomputation, waiting costs every prompt's TTFT."""
        try:
            return await self.bus.request(subject, msg, expected, self.timeout_s, responder_grace_s=0.0)
        except (BusError, nats.errors.Error) as exc:
            log.warning("cache request failed", subject=subject, kind=msg.KIND, error=str(exc))
            return None
