"""Hosting an engine inside an asyncio service: every engine call runs on one dedicated thread (the engine is not
thread-safe), and the step loop runs ticks on that thread while the event loop delivers the previous tick's results.

Also loading the engine the settings name (the model, or the sim backend) and the byte form of a KV block as the
cache-store keeps it. Nothing here knows prefill from decode.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from shared.config import EngineSettings
from shared.engine.blocks import BlockEventHook
from shared.engine.engine import LLMEngine
from shared.wire.log import get_logger

log = get_logger(__name__)
MAX_FAILED_TICKS = 5
R = TypeVar("R")
Tick = Callable[[], tuple[list[R], bool]]  # engine thread: (results to deliver, whether work remains)
Deliver = Callable[[list[R]], Coroutine[Any, Any, None]]  # event loop: one tick's results, in tick order


class EngineHost(Generic[R]):
    """Owns the engine thread and the step loop.

    A step that raises fails only its request (the engine isolates it); a tick that raises is logged and the loop
    goes on. When the engine is broken (`LLMEngine.is_broken`) or `max_failed_ticks` ticks fail in a row, the loop
    stops and sets `broken`: the service then stops, so that its supervisor restarts it and the scheduler fails
    what it held.

    Args:
        engine: the engine; touch it only through `call` or inside the tick.
        idle_poll_s: how often an idle loop ticks anyway (to notice timers such as deadlines).
        max_failed_ticks: ticks failing in a row after which the engine counts as broken.
    """

    def __init__(self, engine: LLMEngine, idle_poll_s: float = 0.2, max_failed_ticks: int = MAX_FAILED_TICKS) -> None:
        self.engine = engine
        self.idle_poll_s = idle_poll_s
        self.max_failed_ticks = max_failed_ticks
        self.broken = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop = asyncio.get_event_loop()

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The engine thread's executor (a virtual cluster runs it in lock-step with its clock)."""
        return self._executor

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the engine thread (after whatever runs there now)."""
        return await self.loop.run_in_executor(self._executor, fn, *args)

    def start(self, tick: Tick[R], deliver: Deliver[R]) -> None:
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(tick, deliver), name="engine-loop")

    def wake(self) -> None:
        """New work: tick now instead of at the next idle poll."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def _run(self, tick: Tick[R], deliver: Deliver[R]) -> None:
        """Tick, then deliver that tick's results while the next tick runs (the engine thread never waits for the
        event loop to publish); deliveries stay in order, and an idle engine's results go out at once."""
        num_failed = 0
        delivering: asyncio.Task[None] | None = None
        try:
            while True:
                self._wake.clear()
                results: list[R] = []
                try:
                    results, busy = await self.call(tick)
                    num_failed = 0
                except Exception:
                    num_failed += 1
                    log.exception("engine tick failed", consecutive_failures=num_failed)
                    busy = False
                if delivering is not None and not await self._delivered(delivering):
                    num_failed += 1
                delivering = asyncio.create_task(deliver(results), name="engine-deliver") if results else None
                if self.engine.is_broken or num_failed >= self.max_failed_ticks:
                    if delivering is not None:
                        await self._delivered(delivering)
                    log.error("the engine cannot recover: stopping so that this instance is restarted",
                              failed_ticks=num_failed, failed_steps=self.engine.isolation.num_consecutive_failures)
                    self.broken.set()
                    return
                if not busy:
                    if delivering is not None and not await self._delivered(delivering):
                        num_failed += 1
                    delivering = None
                    try:
                        async with asyncio.timeout(self.idle_poll_s):
                            await self._wake.wait()
                    except TimeoutError:
                        pass
        finally:
            if delivering is not None:
                delivering.cancel()

    @staticmethod
    async def _delivered(delivering: asyncio.Task[None]) -> bool:
        """Wait for a delivery; False (logged) when it raised."""
        try:
            await delivering
        except Exception:
            log.exception("delivering an engine tick's results failed")
            return False
        return True


async def load_engine(
    settings: EngineSettings, prompt_only: bool = False, on_block_event: BlockEventHook | None = None
) -> LLMEngine:
    """The engine `TSUKIMI_ENGINE` names: the model (loaded on a worker thread), or the sim backend's stand-in for
    `TSUKIMI_SIM_PROFILE`; `prompt_only` for a prefill instance's (`EngineConfig.prompt_only`), `on_block_event` to
    hear its prefix cache's changes."""
    config = dataclasses.replace(settings.engine, prompt_only=prompt_only)
    if settings.engine_kind == "sim":
        from shared.sim.engine import build_sim_engine

        engine = await asyncio.to_thread(build_sim_engine, settings.sim_profile, config, None, on_block_event,
                                         settings.sim_kv_codec, settings.sim_kv_tokens)
        log.info("simulated engine: steps sleep for a roofline model, no model runs", profile=settings.sim_profile,
                 sized_kv_codec=settings.sim_kv_codec,
                 kv_blocks=engine.block_manager.num_blocks, block_size=settings.engine.block_size)
        return engine
    engine = await asyncio.to_thread(LLMEngine.from_path, settings.model_path, config, on_block_event)
    blocks = engine.block_manager.num_blocks
    log.info("KV pool", mib=engine.runner.store.num_bytes >> 20, blocks=blocks, tokens=blocks * config.block_size,
             sized_by="TSUKIMI_KV_CACHE_MB" if config.kv_cache_bytes else "available memory (TSUKIMI_KV_CACHE_MB=auto)",
             memory_fraction=None if config.kv_cache_bytes else config.kv_memory_fraction, kv_format=config.kv_format)
    return engine
