"""EngineHost's step loop: a tick's results go out while the next tick runs, in order, and none is lost.

The engine is a stand-in (the loop only asks whether it is broken); the ticks and deliveries are real coroutines and
threads, timed by events rather than sleeps where the order is what is checked.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

from services.common.engine_host import EngineHost


def _engine() -> Any:
    return SimpleNamespace(is_broken=False, isolation=SimpleNamespace(num_consecutive_failures=0))


async def test_the_next_tick_runs_while_the_previous_results_are_delivered() -> None:
    host: EngineHost[int] = EngineHost(_engine(), idle_poll_s=0.05)
    delivery_started = threading.Event()
    ticks: list[tuple[int, bool]] = []  # (tick number, whether the previous delivery had started by then)
    delivered: list[int] = []
    release_delivery = asyncio.Event()

    def tick() -> tuple[list[int], bool]:
        number = len(ticks) + 1
        if number == 2:  # the first tick's delivery must be under way while this tick runs
            ticks.append((number, delivery_started.wait(timeout=5)))
            host.loop.call_soon_threadsafe(release_delivery.set)
        else:
            ticks.append((number, True))
        return ([number] if number <= 3 else []), number < 3

    async def deliver(results: list[int]) -> None:
        if results == [1]:
            delivery_started.set()
            await release_delivery.wait()  # held until the second tick has run
        delivered.extend(results)

    host.start(tick, deliver)
    for _ in range(200):
        if delivered == [1, 2, 3]:
            break
        await asyncio.sleep(0.01)
    await host.stop()
    assert ticks[:3] == [(1, True), (2, True), (3, True)]
    assert delivered == [1, 2, 3]


async def test_an_idle_engines_last_results_go_out_without_a_next_tick() -> None:
    host: EngineHost[str] = EngineHost(_engine(), idle_poll_s=10.0)  # no idle tick within the test
    delivered: list[str] = []

    def tick() -> tuple[list[str], bool]:
        return ["last"], False

    async def deliver(results: list[str]) -> None:
        delivered.extend(results)

    host.start(tick, deliver)
    started = time.monotonic()
    while not delivered and time.monotonic() - started < 5:
        await asyncio.sleep(0.01)
    await host.stop()
    assert delivered == ["last"]


async def test_a_failing_delivery_is_logged_and_the_loop_goes_on() -> None:
    host: EngineHost[int] = EngineHost(_engine(), idle_poll_s=0.01)
    delivered: list[int] = []
    count = 0

    def tick() -> tuple[list[int], bool]:
        nonlocal count
        count += 1
        return [count], count < 4

    async def deliver(results: list[int]) -> None:
        if results == [2]:
            raise RuntimeError("publish failed")
        delivered.extend(results)

    host.start(tick, deliver)
    for _ in range(300):
        if 4 in delivered:
            break
        await asyncio.sleep(0.01)
    await host.stop()
    assert delivered[:3] == [1, 3, 4]
    assert not host.broken.is_set()
