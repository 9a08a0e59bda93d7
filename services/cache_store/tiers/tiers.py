"""The cache-store's tiers together: DRAM in front of an optional SSD; admission to SSD of blocks seen twice, promotion
of SSD hits, read leases, background SSD writes, per-tier stats. Changes are reported through a callback as `stored`
(committed) or `removed` (gone from every tier); NATS, parts on the wire and epochs belong to `services.cache_store`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from services.cache_store.tiers.block import StoredBlock
from services.cache_store.tiers.dram import DramFullError, DramTier
from services.cache_store.tiers.policy import LatencyStats, Leases, SeenCounter
from services.cache_store.tiers.ssd import CorruptBlockError, SsdTier
from shared.wire.log import get_logger

log = get_logger(__name__)

ADMIT_AFTER = 2  # default: a block evicted from DRAM goes to SSD only if put or asked for at least this often
LEASE_S = 10.0  # a multi-part read holds its block this long at most
SEEN_ENTRIES = 1 << 16  # hashes the admission counter remembers
CLOSE_FLUSH_S = 5.0  # close() waits this long for queued SSD writes

OnChange = Callable[[str, list[int]], None]  # ("stored" | "removed", hashes), called right after the change


@dataclass(frozen=True)
class TierStats:
    """One tier's figures. Hits and misses count block lookups (part 0), latency every part served from the tier."""

    hits: int
    misses: int
    evictions: int
    num_blocks: int
    num_bytes: int
    capacity_bytes: int
    num_gets: int
    get_mean_ms: float
    get_max_ms: float


@dataclass(frozen=True)
class CacheStats:
    """The whole store's figures (`TieredStore.stats`)."""

    num_blocks: int  # distinct blocks held in any tier
    dram: TierStats
    ssd: TierStats | None
    num_writing: int  # evicted from DRAM, being written to SSD (still served)
    num_leased: int
    num_admitted: int  # DRAM evictions written to SSD
    num_dropped: int  # DRAM evictions not admitted (seen once) or whose SSD write failed
    num_corrupt: int  # SSD files that failed their checks (on read or at re-index) and were deleted


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    latency: LatencyStats = field(default_factory=LatencyStats)


class TieredStore:
    """Where each committed block lives, and what a put or a get does to that.

    Args:
        dram: the DRAM tier.
        ssd: the SSD tier, or None.
        on_change: told ("stored", hashes) after a commit and ("removed", hashes) when blocks left every tier;
            moves between tiers are not reported.
        clock: monotonic seconds, for leases.
        admit_after: sightings (puts and gets) a block needs to be written to SSD when it leaves DRAM.
    """

    def __init__(
        self, dram: DramTier[StoredBlock], ssd: SsdTier | None, on_change: OnChange,
        clock: Callable[[], float] = time.monotonic, admit_after: int = ADMIT_AFTER,
    ) -> None:
        self.dram, self.ssd, self.on_change = dram, ssd, on_change
        self.admit_after = admit_after
        self.leases = Leases(LEASE_S, clock)
        self.seen = SeenCounter(SEEN_ENTRIES)
        self._writing: dict[int, StoredBlock] = {}  # evicted from DRAM, queued or being written to SSD
        self._writing_bytes = 0
        self._queue: asyncio.Queue[int] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._reading: Counter[int] = Counter()  # SSD reads in flight
        self._dram, self._ssd = _Counters(), _Counters()
        self._num_admitted = self._num_dropped = self._num_corrupt = 0

    async def open(self) -> list[int]:
        """Re-index the SSD tier (headers only, in a thread); returns what it holds, least recently used first.

        Raises:
            OSError: the SSD folder cannot be used (see `SsdTier.open`).
        """
        if self.ssd is None:
            return []
        report = await asyncio.to_thread(self.ssd.open)
        self._num_corrupt += report.num_corrupt_removed
        log.info("ssd tier re-indexed", folder=str(self.ssd.folder), **vars(report))
        return self.ssd.hashes()

    async def close(self) -> None:
        """Finish the queued SSD writes (waiting at most `CLOSE_FLUSH_S`), forget DRAM, release the SSD folder."""
        if self._writer is not None:
            try:
                await asyncio.wait_for(self.flush(), CLOSE_FLUSH_S)
            except TimeoutError:
                log.warning("gave up on queued ssd writes", num_blocks=len(self._writing))
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None
        self.dram.clear()
        self._writing.clear()
        self._writing_bytes = 0
        self._queue = asyncio.Queue()  # what a timed-out flush left in it is forgotten with DRAM
        if self.ssd is not None:
            self.ssd.close()

    async def flush(self) -> None:
        """Wait until every block evicted so far is on SSD (or dropped)."""
        await self._queue.join()

    def holds(self, block_hash: int) -> bool:
        return (
            self.dram.has(block_hash) or block_hash in self._writing
            or (self.ssd is not None and self.ssd.has(block_hash))
        )

    def hashes(self) -> list[int]:
        """Every hash held in any tier."""
        return list(dict.fromkeys([*self.dram.hashes(), *self._writing, *(self.ssd.hashes() if self.ssd else [])]))

    @property
    def num_blocks(self) -> int:
        """Distinct blocks in any tier (in the time of the SSD tier's size, not DRAM's: every heartbeat asks)."""
        dram = self.dram
        held = dram.num_blocks + sum(1 for h in self._writing if not dram.has(h))
        if self.ssd is not None:
            held += sum(1 for h in self.ssd.hashes() if not dram.has(h) and h not in self._writing)
        return held

    async def put(self, block_hash: int, block: StoredBlock) -> None:
        """Commit a verified block to DRAM and report it `stored` (a block already held only counts as seen).

        When DRAM is short of room because SSD writes lag, this waits for them once.

        Raises:
            ValueError: the block is larger than DRAM, or there is no room (`DramFullError`: all leased).
        """
        self.seen.add(block_hash)
        for attempt in range(2):
            if self.holds(block_hash):
                return
            try:
                evicted = self.dram.put(block_hash, block, self._is_pinned, self._writing_bytes)
            except DramFullError:
                if attempt or not self._writing:
                    raise
                await self.flush()
                continue
            self._evicted(evicted)
            self.on_change("stored", [block_hash])
            return

    def remove(self, block_hash: int) -> bool:
        """Drop a block from every tier and report it `removed`; False (nothing done) while a read holds it."""
        if self._is_pinned(block_hash):
            return False
        self.dram.remove(block_hash)
        writing = self._writing.pop(block_hash, None)  # its queued write then finds nothing to write
        if writing is not None:
            self._writing_bytes -= len(writing)
        if self.ssd is not None:
            self.ssd.remove(block_hash)
        self._report_removed([block_hash])
        return True

    async def get(self, block_hash: int, part: int = 0) -> StoredBlock | None:
        """The block, for a read of part `part`; None when no tier holds it.

        Part 0 counts as a lookup (a hit or a miss per tier, and a sighting for admission) and takes a read lease;
        other parts tick the lease off. An SSD hit is verified and promoted into DRAM (the file stays); a corrupt file
        is deleted, reported `removed`, and is a miss.
        """
        start = time.perf_counter()
        if part == 0:
            self.seen.add(block_hash)
        block, counters = self.dram.get(block_hash), self._dram
        if block is None:
            block = self._writing.get(block_hash)
        if block is None and self.ssd is not None:
            if part == 0:
                self._dram.misses += 1
            block, counters = await self._read_ssd(block_hash), self._ssd
        if block is None:
            counters.misses += int(part == 0)
            return None
        counters.hits += int(part == 0)
        counters.latency.record(time.perf_counter() - start)
        if part == 0:
            self.leases.take(block_hash, len(block.parts))
        else:
            self.leases.served(block_hash, part)
        return block

    def stats(self) -> CacheStats:
        ssd = None
        if self.ssd is not None:
            ssd = _tier_stats(self._ssd, self.ssd.num_blocks, self.ssd.num_bytes, self.ssd.capacity_bytes)
        return CacheStats(
            num_blocks=self.num_blocks,
            dram=_tier_stats(self._dram, self.dram.num_blocks, self.dram.num_bytes, self.dram.capacity_bytes),
            ssd=ssd, num_writing=len(self._writing), num_leased=len(self.leases), num_admitted=self._num_admitted,
            num_dropped=self._num_dropped, num_corrupt=self._num_corrupt,
        )

    def _is_pinned(self, block_hash: int) -> bool:
        return self.leases.is_leased(block_hash) or block_hash in self._reading

    def _evicted(self, evicted: list[tuple[int, StoredBlock]]) -> None:
        """Blocks evicted from DRAM: already on SSD (promoted earlier) stay there, seen twice go there, others go."""
        self._dram.evictions += len(evicted)
        dropped = []
        for block_hash, block in evicted:
            if self.ssd is not None and self.ssd.has(block_hash):
                continue  # its file stays: nothing changes for listeners
            if self.ssd is not None and self.seen.count(block_hash) >= self.admit_after:
                self._writing[block_hash] = block
                self._writing_bytes += len(block)
                self._queue.put_nowait(block_hash)
            else:
                dropped.append(block_hash)
        self._num_dropped += len(dropped)
        self._report_removed(dropped)
        if self._writing and (self._writer is None or self._writer.done()):
            self._writer = asyncio.get_running_loop().create_task(self._write_out(), name="cache-ssd-writer")

    async def _write_out(self) -> None:
        while True:
            block_hash = await self._queue.get()
            try:
                await self._write_one(block_hash)
            except Exception:  # a bug must not stop the writer (flush() would wait forever)
                log.exception("ssd write crashed", block_hash=block_hash)
            finally:
                self._queue.task_done()

    async def _write_one(self, block_hash: int) -> None:
        block = self._writing.get(block_hash)
        if block is None or self.ssd is None:
            return
        gone = []
        try:
            reservation = self.ssd.reserve(block_hash, block, self._is_pinned)
            self._ssd.evictions += len(reservation.evicted)
            self._report_removed(reservation.evicted)
            await self.ssd.write(reservation)
            self._num_admitted += 1
        except (OSError, ValueError) as exc:
            log.warning("ssd write failed; block dropped", block_hash=block_hash, error=str(exc))
            self._num_dropped += 1
            gone.append(block_hash)
        finally:
            if self._writing.pop(block_hash, None) is not None:
                self._writing_bytes -= len(block)
        self._report_removed(gone)

    async def _read_ssd(self, block_hash: int) -> StoredBlock | None:
        assert self.ssd is not None
        self._reading[block_hash] += 1
        try:
            block = await self.ssd.get(block_hash)
        except CorruptBlockError as exc:
            log.warning("corrupt ssd block deleted", block_hash=block_hash, error=str(exc))
            self._num_corrupt += 1
            self._report_removed([block_hash])
            return None
        finally:
            self._reading[block_hash] -= 1
            if not self._reading[block_hash]:
                del self._reading[block_hash]
        if block is not None and not self.dram.has(block_hash):
            try:  # promote; the file stays, so a later eviction from DRAM costs no write
                self._evicted(self.dram.put(block_hash, block, self._is_pinned, self._writing_bytes))
            except ValueError:
                pass  # no room now: this read is served from the copy just read
        return block

    def _report_removed(self, block_hashes: list[int]) -> None:
        gone = [h for h in block_hashes if not self.holds(h)]
        if gone:
            self.on_change("removed", gone)


def _tier_stats(counters: _Counters, num_blocks: int, num_bytes: int, capacity_bytes: int) -> TierStats:
    latency = counters.latency
    return TierStats(
        counters.hits, counters.misses, counters.evictions, num_blocks, num_bytes, capacity_bytes,
        latency.count, latency.mean_ms, 1000.0 * latency.max_s,
    )
