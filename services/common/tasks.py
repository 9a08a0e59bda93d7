"""The background tasks a service starts: kept until they end (asyncio holds only weak references), their failures
logged, and all of them cancelled and awaited when the service stops."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from shared.wire.log import get_logger

log = get_logger(__name__)


class BackgroundTasks:
    """A service's tasks that nobody awaits (a KV send, a cache put, a publish)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` as a task named `name`; an exception it raises is logged, never lost."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", task=task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        """Cancel every task still running and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)
