"""Run planned requests against a server: open loop (each at its arrival time) or fixed concurrency (closed
loop), bounded by a request count and a duration, with one aiohttp session. Returns the records and summary.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

import aiohttp

from loadgen.client import ClientOptions, send_request
from loadgen.metrics import Slo, Summary, summarize
from loadgen.progress import Progress
from loadgen.record import RequestRecord
from loadgen.workload import PlannedRequest

MAX_RETRY_WAIT_S = 60.0  # a closed-loop worker waits at most this long on a `Retry-After`


@dataclass(frozen=True)
class RunOptions:
    """How to run a workload.

    Args:
        client: where and how each request is sent.
        concurrency: None runs open loop (each request at its `arrival_s`); N keeps N requests in flight and
            starts the next one when one finishes, ignoring arrival times.
        max_requests: send at most this many (None: all).
        duration_s: send nothing after this many seconds, then wait for the requests in flight (each is bounded
            by the request timeout).
        slo: the objectives of the summary.
        show_progress: draw the progress line on stderr.
        connection_limit: the session's limit on open connections.
        honor_retry_after: in closed loop, a worker whose request was refused with a `Retry-After` waits that long
            (at most `MAX_RETRY_WAIT_S`, never past the duration) before its next request, as a client told "busy,
            come back in N s" does; without it a refusal frees the slot at once, and an overloaded server that
            refuses in a millisecond is sent the whole remaining workload in a burst of refusals.
    """

    client: ClientOptions
    concurrency: int | None = None
    max_requests: int | None = None
    duration_s: float | None = None
    slo: Slo = field(default_factory=Slo)
    show_progress: bool = True
    connection_limit: int = 1024
    honor_retry_after: bool = True

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be positive, got {self.duration_s}")


@dataclass(frozen=True)
class RunResult:
    """Every sent request's record (by request id) and their summary."""

    records: list[RequestRecord]
    summary: Summary


async def run(
    requests: Sequence[PlannedRequest], options: RunOptions, progress_stream: TextIO | None = None
) -> RunResult:
    """Send `requests` (in arrival order) as `options` says and measure them. Failed requests are recorded,
    never raised."""
    planned = sorted(requests, key=lambda r: r.arrival_s)[: options.max_requests]
    last_arrival_s = planned[-1].arrival_s if planned and options.concurrency is None else 0.0
    progress = Progress(
        len(planned), options.duration_s, last_arrival_s, progress_stream, is_enabled=options.show_progress
    )
    connector = aiohttp.TCPConnector(limit=options.connection_limit)
    no_timeout = aiohttp.ClientTimeout(total=None)  # each request has its own (aiohttp's default is 5 minutes)
    async with aiohttp.ClientSession(connector=connector, timeout=no_timeout) as session:
        drawing = asyncio.create_task(progress.run())
        try:
            sender = _Sender(session, options, progress)
            if options.concurrency is None:
                records = await sender.open_loop(planned)
            else:
                records = await sender.closed_loop(planned, options.concurrency)
        finally:
            drawing.cancel()
        progress.close()
    records.sort(key=lambda r: r.request_id)
    return RunResult(records, summarize(records, options.slo))


class _Sender:
    def __init__(self, session: aiohttp.ClientSession, options: RunOptions, progress: Progress) -> None:
        self.session = session
        self.options = options
        self.progress = progress
        self.t0 = time.perf_counter()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def is_past_deadline(self, at_s: float) -> bool:
        return self.options.duration_s is not None and at_s >= self.options.duration_s

    async def send(self, planned: PlannedRequest, arrival_s: float) -> RequestRecord:
        self.progress.on_sent()
        record = await send_request(self.session, planned, self.options.client, self.t0, arrival_s)
        self.progress.on_finished(record)
        return record

    async def open_loop(self, planned: Sequence[PlannedRequest]) -> list[RequestRecord]:
        """Fire each request at its arrival time; stop at the duration; wait for what is in flight."""
        tasks = []
        for request in planned:
            if self.is_past_deadline(request.arrival_s):
                break
            delay_s = request.arrival_s - self.elapsed_s()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            tasks.append(asyncio.create_task(self.send(request, request.arrival_s)))
        return list(await asyncio.gather(*tasks))

    async def closed_loop(self, planned: Sequence[PlannedRequest], concurrency: int) -> list[RequestRecord]:
        """`concurrency` workers take the next request as soon as their previous one ends."""
        pending = iter(planned)  # shared by the workers; next() never awaits, so no two take the same one
        records: list[RequestRecord] = []

        async def worker() -> None:
            previous: RequestRecord | None = None
            for request in pending:
                if previous is not None:
                    await self.back_off(previous)
                now_s = self.elapsed_s()
                if self.is_past_deadline(now_s):
                    return
                previous = await self.send(request, now_s)
                records.append(previous)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(planned)))))
        return records

    async def back_off(self, record: RequestRecord) -> None:
        """Wait out a refusal's `Retry-After` (closed loop), capped, and never past the duration."""
        if not self.options.honor_retry_after or record.retry_after_s is None:
            return
        wait_s = min(record.retry_after_s, MAX_RETRY_WAIT_S)
        if self.options.duration_s is not None:
            wait_s = min(wait_s, self.options.duration_s - self.elapsed_s())
        if wait_s > 0:
            await asyncio.sleep(wait_s)
