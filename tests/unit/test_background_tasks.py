"""A service's background tasks: kept while they run, a failure logged rather than lost, all cancelled on close."""

from __future__ import annotations

import asyncio

import structlog

from services.common.tasks import BackgroundTasks


async def test_tasks_are_kept_until_they_end_and_close_cancels_the_rest() -> None:
    tasks = BackgroundTasks()
    done = asyncio.Event()
    cancelled: list[str] = []

    async def quick() -> None:
        done.set()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append("forever")
            raise

    tasks.spawn(quick(), "quick")
    tasks.spawn(forever(), "forever")
    await done.wait()
    await asyncio.sleep(0)
    assert len(tasks) == 1  # the finished one is let go
    await tasks.close()
    assert cancelled == ["forever"] and len(tasks) == 0


async def test_a_failing_task_is_logged_with_its_name() -> None:
    tasks = BackgroundTasks()

    async def broken() -> None:
        raise RuntimeError("boom")

    with structlog.testing.capture_logs() as logs:
        task = tasks.spawn(broken(), "store-blocks-r1")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
    failures = [entry for entry in logs if entry["event"] == "background task failed"]
    assert len(failures) == 1 and failures[0]["task"] == "store-blocks-r1"
    assert len(tasks) == 0
