"""The virtual clock (`services.virtual.clock`): the loop jumps to the next timer at once; executor work takes the
virtual time it sleeps, one call after another per executor, and what it hands the loop happens at its own clock;
a threaded executor's work can wait for the loop (a condition) in lock-step; `time` reads the virtual clock only
while a run is on; a run that waits for nothing that can come says so."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.virtual import clock


@pytest.fixture(autouse=True)
def installed() -> Iterator[None]:
    clock.install()
    yield
    clock.uninstall()


def test_an_hour_of_sleeping_takes_no_wall_time() -> None:
    async def main() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        start_wall = clock.wall_clock()
        await asyncio.sleep(3600)
        started = time.monotonic()
        await asyncio.gather(asyncio.sleep(1.5), asyncio.sleep(0.5))
        return loop.time(), time.monotonic() - started, clock.wall_clock() - start_wall

    virtual, gathered, wall = clock.run_virtual(main)
    assert virtual == pytest.approx(3601.5) and gathered == pytest.approx(1.5)
    assert wall < 1.0
    assert abs(time.time() - clock._REAL[2]()) < 1.0  # real again once the run is over


def test_executor_work_takes_the_time_it_sleeps_one_call_after_another() -> None:
    engine = ThreadPoolExecutor(1)
    seen: list[tuple[str, float]] = []

    def step(name: str, seconds: float) -> float:
        time.sleep(seconds)  # the sim engine's pacing
        loop.call_soon_threadsafe(seen.append, (name, 0.0))  # handed to the loop at the work's own clock
        return time.perf_counter()

    async def main() -> list[float]:
        nonlocal loop
        loop = asyncio.get_running_loop()
        a = loop.run_in_executor(engine, step, "a", 2.0)
        b = loop.run_in_executor(engine, step, "b", 3.0)  # queued behind a, as on one thread
        other = loop.run_in_executor(None, time.monotonic)  # another executor: not behind the engine
        ended = await asyncio.gather(a, b)
        assert await other == 0.0
        seen.append(("now", loop.time()))
        return list(ended)

    loop: asyncio.AbstractEventLoop | None = None
    assert clock.run_virtual(main) == [2.0, 5.0]
    assert seen == [("a", 0.0), ("b", 0.0), ("now", 5.0)]


def test_threaded_work_waits_for_the_loop_in_lock_step() -> None:
    """A prefill engine waits for prefix KV that the loop receives later; its clock resumes from the moment the
    loop notified it, and a timeout counts virtual seconds."""
    engine = ThreadPoolExecutor(1)
    condition = clock.VirtualCondition()
    arrived: list[int] = []

    def wait_for_layer() -> tuple[bool, float, bool, float]:
        time.sleep(1.0)
        with condition:
            notified = condition.wait(10.0)
        got = time.monotonic()
        with condition:
            timed_out = not condition.wait(5.0)
        return notified and arrived == [1], got, timed_out, time.monotonic()

    async def main() -> tuple[bool, float, bool, float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, clock.VirtualLoop)
        loop.mark_threaded(engine)
        work = loop.run_in_executor(engine, wait_for_layer)
        await asyncio.sleep(4.0)
        with condition:
            arrived.append(1)
            condition.notify_all()
        return await work

    notified, got, timed_out, ended = clock.run_virtual(main)
    assert notified and got == pytest.approx(4.0)
    assert timed_out and ended == pytest.approx(9.0)


def test_a_condition_waits_only_on_a_threaded_executor() -> None:
    async def main() -> None:
        with condition:
            condition.wait(1.0)

    condition = clock.VirtualCondition()
    with pytest.raises(RuntimeError, match="threaded"):
        clock.run_virtual(main)


def test_a_run_that_waits_for_what_never_comes_says_so() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(clock.VirtualTimeStalled, match="never happen"):
        clock.run_virtual(main)


def test_sleeping_on_the_loop_is_refused_under_virtual_time() -> None:
    async def main() -> None:
        time.sleep(1.0)

    with pytest.raises(RuntimeError, match="event loop"):
        clock.run_virtual(main)
