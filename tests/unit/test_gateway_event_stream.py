"""The gateway's per-request event stream: events in order, a wait that times out, and one timer per stream however
many tokens it waits for."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from services.gateway.backend import NatsBackend, _NatsEventStream
from shared.wire.protocol import StreamEvent


def _stream() -> _NatsEventStream:
    return _NatsEventStream(cast(NatsBackend, None), "r1")


def _event(index: int) -> StreamEvent:
    return StreamEvent("r1", index, [index], "x")


async def test_events_come_in_order_and_a_silent_stream_times_out() -> None:
    stream = _stream()
    await stream.on_message(_event(0))
    await stream.on_message(_event(1))
    assert [(await stream.next_event(1.0)).index for _ in range(2)] == [0, 1]  # type: ignore[union-attr]
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await stream.next_event(0.05) is None
    assert loop.time() - started >= 0.05


async def test_an_event_wakes_a_waiting_stream() -> None:
    stream = _stream()
    waiting = asyncio.create_task(stream.next_event(5.0))
    await asyncio.sleep(0)
    await stream.on_message(_event(3))
    got = await asyncio.wait_for(waiting, 1.0)
    assert got is not None and got.index == 3


async def test_a_later_deadline_moves_the_timer_and_an_earlier_one_replaces_it() -> None:
    stream = _stream()
    loop = asyncio.get_running_loop()
    before = len(cast(Any, loop)._scheduled)
    for index in range(50):  # a wait per token: the stream keeps one timer, not one a wait
        waiting = asyncio.create_task(stream.next_event(30.0))
        await asyncio.sleep(0)
        await stream.on_message(_event(index))
        assert (await waiting) is not None
    assert len(cast(Any, loop)._scheduled) - before <= 1
    started = loop.time()
    assert await stream.next_event(0.05) is None  # shorter than the armed 30 s: a timer of its own
    assert 0.05 <= loop.time() - started < 5.0
    await stream.close()
