"""The gateway's view of the cluster: the `Backend` interface (submit, stream events, cancel, who is alive) and
`NatsBackend`, its implementation over the bus. Tests drive the HTTP side with a fake backend instead.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from nats.aio.subscription import Subscription

from shared.wire.bus import Bus, BusError
from shared.wire.heartbeat import LiveInstances
from shared.wire.log import get_logger
from shared.wire.protocol import Cancel, Heartbeat, Role, StreamEvent, SubmitReply, SubmitRequest

log = get_logger(__name__)
# /health needs one live instance of each (a colocated deployment: no prefill)
ROLES_FOR_HEALTH = (Role.SCHEDULER.value, Role.PREFILL.value, Role.DECODE.value)
COLOCATED_ROLES_FOR_HEALTH = (Role.SCHEDULER.value, Role.DECODE.value)


class BackendUnavailable(Exception):
    """The scheduler did not answer (no responder, a timeout, a broken reply)."""


class EventStream(Protocol):
    """The `StreamEvent`s of one request, in arrival order (not necessarily `index` order)."""

    async def next_event(self, timeout_s: float) -> StreamEvent | None:
        """The next event, or None when none arrived within `timeout_s`."""
        ...

    async def close(self) -> None:
        """Stop listening (idempotent)."""
        ...


class Backend(Protocol):
    """What the HTTP side needs from the rest of tsukimi.

    A request's stream must be opened before it is submitted, so that no event can be published before anyone
    listens.
    """

    async def open_stream(self, request_id: str) -> EventStream: ...

    async def submit(self, request: SubmitRequest) -> SubmitReply:
        """Ask the scheduler to place the request. Raises BackendUnavailable when it does not answer."""
        ...

    async def cancel(self, request_id: str, reason: str) -> None:
        """Tell every instance to drop the request (best effort, never raises)."""
        ...

    def num_alive(self, role: str) -> int:
        """Live instances of a role (from heartbeats)."""
        ...

    def num_waiting(self, role: str) -> int:
        """Requests waiting at the live instances of a role (the sum of their heartbeats' `num_waiting`)."""
        ...

    def instances(self) -> list[Heartbeat]:
        """The latest heartbeat of every live instance."""
        ...


class _NatsEventStream:
    """One request's events as they arrive. A wait per token makes no timer: the stream keeps one, and when it fires
    early (the stream made progress since it was set) it moves on to the latest deadline."""

    def __init__(self, backend: NatsBackend, request_id: str) -> None:
        self.backend, self.request_id = backend, request_id
        self.events: deque[StreamEvent] = deque()
        self.subscription: Subscription | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def on_message(self, msg: StreamEvent) -> None:
        if msg.request_id != self.request_id:
            log.warning("unexpected message on a stream subject", request_id=self.request_id, kind=msg.KIND)
            return
        self.events.append(msg)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_event(self, timeout_s: float) -> StreamEvent | None:
        if self.events:
            return self.events.popleft()
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout_s
        if self._timer is not None and self._timer.when() > self._deadline:
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._on_timer, loop)
        self._waiter = loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        return self.events.popleft() if self.events else None

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return  # nobody waits: the next wait sets a timer
        if loop.time() >= self._deadline:
            self._waiter.set_result(None)  # timed out: next_event finds no event
        else:
            self._timer = loop.call_at(self._deadline, self._on_timer, loop)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        subscription, self.subscription = self.subscription, None
        if subscription is None:
            return
        self.backend.streams.pop(self.request_id, None)
        try:
            await subscription.unsubscribe()
        except Exception as exc:  # a closed connection has no subscriptions left to leak
            log.warning("unsubscribe failed", request_id=self.request_id, error=str(exc))


class NatsBackend:
    """`Backend` over NATS: `sched.submit` request/reply, `stream.<id>` subscriptions, the scheduler's failures of
    requests whose instance was lost (`sched.failed`, delivered to their streams), `cancel`, heartbeats.

    Args:
        bus: a connected bus.
        instance_timeout_s: an instance silent this long no longer counts as alive.
        submit_timeout_s: how long to wait for the scheduler's answer.
    """

    def __init__(self, bus: Bus, instance_timeout_s: float, submit_timeout_s: float = 5.0) -> None:
        self.bus = bus
        self.live = LiveInstances(instance_timeout_s)
        self.submit_timeout_s = submit_timeout_s
        self.streams: dict[str, _NatsEventStream] = {}  # open, by request id
        self._subscriptions: list[Subscription] = []

    @property
    def num_open_streams(self) -> int:
        return len(self.streams)

    async def start(self) -> None:
        """Start following heartbeats and the scheduler's failures."""
        subjects = self.bus.subjects
        self._subscriptions = [
            await self.bus.route(subjects.heartbeat_all, {Heartbeat: self._on_heartbeat}, bind_sender=True),
            await self.bus.route(subjects.failed, {StreamEvent: self._on_failure}),
        ]

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions = []

    async def _on_failure(self, msg: StreamEvent) -> None:
        stream = self.streams.get(msg.request_id) if msg.error_type else None
        if stream is not None:
            await stream.on_message(msg)

    async def _on_heartbeat(self, msg: Heartbeat) -> None:
        self.live.record(msg)
        self.live.forget_silent()

    async def open_stream(self, request_id: str) -> EventStream:
        stream = _NatsEventStream(self, request_id)
        # route() flushes: the server holds the subscription before the submit that triggers publishing.
        subject = self.bus.subjects.stream(request_id)
        stream.subscription = await self.bus.route(subject, {StreamEvent: stream.on_message})
        self.streams[request_id] = stream
        return stream

    async def submit(self, request: SubmitRequest) -> SubmitReply:
        try:
            return await self.bus.request(self.bus.subjects.submit, request, SubmitReply, self.submit_timeout_s)
        except BusError as exc:
            raise BackendUnavailable(str(exc)) from None

    async def cancel(self, request_id: str, reason: str) -> None:
        try:
            await self.bus.publish(self.bus.subjects.cancel, Cancel(request_id, reason))
        except Exception as exc:  # the connection may be gone; the instances' own timeouts clean up
            log.warning("cancel failed", request_id=request_id, error=str(exc))

    def num_alive(self, role: str) -> int:
        return len(self.live.alive(role))

    def num_waiting(self, role: str) -> int:
        return sum(beat.num_waiting for beat in self.live.alive(role))

    def instances(self) -> list[Heartbeat]:
        return self.live.alive()
