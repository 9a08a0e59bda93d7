"""Loading a prompt's prefix from the cache-store layer by layer while the engine computes: the `PrefixSource` a
request carries into the engine, and the fetch that feeds its `PrefixLoad` as verified parts arrive.

It fetches through `CacheClient` (which verifies every part) and measures the bandwidth; when to wait is the engine's
business, and a failed load makes the engine recompute.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time

from services.prefill.measure import MovingRate
from shared.engine.kv.prefix_load import PrefixLoad, PrefixSource
from shared.engine.kv.store import KvStore
from shared.wire.cache_client import CacheClient
from shared.wire.log import get_logger

log = get_logger(__name__)


class StoreLoader:
    """Starts prefix loads for the engine (on its thread) and runs their fetches (on the event loop).

    Every block is fetched part by part in order, all blocks at once, so the first layers of every block arrive
    first; each part goes into the store as it arrives.

    Args:
        cache: the cache-store client.
        store: the engine's KV store.
        loop: the event loop the fetches run on.
        timeout_s: a load that makes no progress this long fails (its request is then recomputed).
    """

    def __init__(
        self, cache: CacheClient, store: KvStore, loop: asyncio.AbstractEventLoop, timeout_s: float
    ) -> None:
        self.cache, self.store, self.loop, self.timeout_s = cache, store, loop, timeout_s
        self.bandwidth = MovingRate()  # bytes per second of completed loads
        self._tasks: set[asyncio.Task[None]] = set()
        # The service's context (its log fields), for the fetches the engine thread starts: a thread has its own.
        self._context = contextvars.copy_context()

    def source(self, request_id: str, hashes: list[int], block_size: int) -> PrefixSource:
        """A source of the prompt's first `len(hashes)` blocks, as the cache-store holds them."""
        return PrefixSource(len(hashes) * block_size, functools.partial(self._start, request_id, hashes))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _start(self, request_id: str, hashes: list[int], first_block: int, block_ids: list[int]) -> PrefixLoad:
        """Engine thread, at admission: the load of blocks [first_block, first_block + len(block_ids))."""
        load = PrefixLoad(self.store, block_ids, self.timeout_s, first_block=first_block)
        wanted = hashes[first_block : first_block + len(block_ids)]
        self.loop.call_soon_threadsafe(self._spawn, request_id, wanted, load, context=self._context)
        return load

    def _spawn(self, request_id: str, hashes: list[int], load: PrefixLoad) -> None:
        task = self.loop.create_task(self._fetch(request_id, hashes, load), name=f"prefix-load-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch(self, request_id: str, hashes: list[int], load: PrefixLoad) -> None:
        started = time.monotonic()
        try:
            await asyncio.gather(*(self._fetch_block(i, h, load) for i, h in enumerate(hashes)))
        except asyncio.CancelledError:
            load.fail("the service is stopping")
            raise
        except Exception as exc:  # the engine must never be left waiting
            log.exception("prefix fetch failed", request_id=request_id)
            load.fail(f"{type(exc).__name__}: {exc}")
        seconds = time.monotonic() - started
        if load.is_complete:
            self.bandwidth.add(sum(load.block_sizes), seconds)
            log.info("prefix fetched from the cache-store", request_id=request_id, blocks=len(hashes),
                     ms=round(seconds * 1000, 1))
        elif load.error is not None:
            log.warning("prefix load failed; computing instead", request_id=request_id, error=load.error)

    async def _fetch_block(self, index: int, block_hash: int, load: PrefixLoad) -> None:
        received = 0
        async with contextlib.aclosing(self.cache.get_block_parts(block_hash)) as parts:
            async for raw in parts:
                received += len(raw)
                if not load.write(index, raw):
                    return  # failed or closed: stop fetching
        if received != load.block_sizes[index]:
            load.fail(f"block {block_hash:#x}: {received} of {load.block_sizes[index]} bytes arrived")
