"""An in-process NATS for a virtual cluster: the real `Bus` runs over `VirtualNatsClient`, which speaks the few calls
`Bus` makes of nats-py's client (publish, subscribe with queue groups, request/reply, flush, drain), with NATS's
semantics: subjects of dot-separated tokens with `*` and `>` wildcards, one member of each queue group per message,
each subscription's messages handled one at a time in order, ordering kept per publisher, no responders answered at
once. Each message lands when the `Network` says.

What differs from production, and why: there are no permissions (every service is ours and in one process; NATS's
authorization is tested against the real server), and no reconnects (nothing can disconnect).
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

import nats.errors

from services.virtual.network import Network
from shared.wire.log import get_logger
from shared.wire.payload import CODEC_SIZE_ONLY
from shared.wire.protocol import unchecked_fields

log = get_logger(__name__)
MAX_PAYLOAD = 8 << 20
# Messages landing this close together are delivered together: a decode step's events to one gateway land a few
# nanoseconds apart (each takes its bytes' time on the link), and a loop pass each would cost more than it shows.
SAME_INSTANT_S = 1e-6
_SIZE_ONLY_MARK = CODEC_SIZE_ONLY.encode()


class VirtualMsg:
    """What a subscription's callback gets (nats-py's `Msg`: data, subject, reply, respond)."""

    __slots__ = ("subject", "reply", "data", "_client")

    def __init__(self, subject: str, reply: str, data: bytes, client: VirtualNatsClient) -> None:
        self.subject, self.reply, self.data, self._client = subject, reply, data, client

    async def respond(self, data: bytes) -> None:
        if not self.reply:
            raise nats.errors.Error("no reply subject to respond to")
        await self._client.publish(self.reply, data)


class VirtualSubscription:
    """One subscription: its callback handles its messages one at a time, in order.

    A message that finds no handler in progress starts its handler at once, in the delivering callback (most
    handlers finish without waiting for anything, and a task per message would double the simulator's cost); a
    handler that does wait goes on as a task, and the messages that arrive meanwhile wait their turn behind it, as
    nats-py's one task per subscription would have them.
    """

    def __init__(self, server: VirtualNats, client: VirtualNatsClient, subject: str, queue: str,
                 cb: Callable[[VirtualMsg], Awaitable[None]]) -> None:
        self.server, self.client, self.subject, self.queue, self.cb = server, client, subject, queue, cb
        self.tokens = subject.split(".")
        self.is_wildcard = "*" in self.tokens or ">" in self.tokens
        self.last_from: dict[int, float] = {}  # publisher client id -> when its last message here lands
        self._inbox: deque[VirtualMsg] = deque()
        self._worker: asyncio.Task[None] | None = None  # a handler that waits, and the messages queued behind it
        self.is_closed = False

    def put(self, msg: VirtualMsg) -> None:
        if self.is_closed:
            return
        if self._worker is not None:
            self._inbox.append(msg)
            return
        context = self.client.context
        handling = cast(Coroutine[Any, Any, None], self.cb(msg))
        waiting = (_first_step(handling, self.subject) if context is None
                   else context.run(_first_step, handling, self.subject))
        if waiting is not None:
            coro, awaited = waiting
            self._worker = asyncio.get_running_loop().create_task(
                self._go_on(coro, awaited), name=f"sub-{self.subject}", context=context)

    async def _go_on(self, coro: Coroutine[Any, Any, None], awaited: Any) -> None:
        """The handler that waited, to its end; then the messages that came meanwhile, each awaited in turn."""
        try:
            await _finish(coro, awaited)
            while self._inbox and not self.is_closed:
                await self._handle(self._inbox.popleft())
        finally:
            self._worker = None

    async def _handle(self, msg: VirtualMsg) -> None:
        try:
            await self.cb(msg)
        except Exception:  # nats-py logs a failing callback and goes on; so does this
            log.exception("subscription callback failed", subject=self.subject)

    async def unsubscribe(self) -> None:
        self.close()

    async def drain(self) -> None:
        """Handle what has arrived, then unsubscribe."""
        while (self._inbox or self._worker is not None) and not self.is_closed:
            await asyncio.sleep(0)
        self.close()

    def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.server.remove(self)
            self.client.forget(self)
            self._inbox.clear()
            if self._worker is not None and self._worker is not asyncio.current_task():
                self._worker.cancel()


def _first_step(coro: Coroutine[Any, Any, None], subject: str) -> tuple[Coroutine[Any, Any, None], Any] | None:
    """Run a handler up to its first wait: None when it finished, else it and what it waits for."""
    try:
        awaited = coro.send(None)
    except StopIteration:
        return None
    except Exception:
        log.exception("subscription callback failed", subject=subject)
        return None
    return coro, awaited


async def _finish(coro: Coroutine[Any, Any, None], awaited: Any) -> None:
    """Drive a started handler to its end from a task, as a task drives a coroutine: wait for the future it yielded
    (a bare yield is a pass of the loop), then resume it."""
    try:
        while True:
            if awaited is None:
                await asyncio.sleep(0)
            else:
                awaited._asyncio_future_blocking = False
                await asyncio.wait([awaited])
            try:
                awaited = coro.send(None)
            except StopIteration:
                return
    except asyncio.CancelledError:
        coro.close()
        raise
    except Exception:
        log.exception("subscription callback failed")


class VirtualNats:
    """The server: who subscribes to what, and the delivery of each message at its time, in order per publisher.

    Args:
        network: when a message lands.
    """

    def __init__(self, network: Network) -> None:
        self.network = network
        self._exact: dict[str, list[VirtualSubscription]] = {}
        self._wildcards: list[VirtualSubscription] = []
        self._groups: dict[tuple[str, str], itertools.count[int]] = {}  # (pattern, queue) -> round-robin counter
        self._due: list[tuple[float, int, VirtualSubscription, VirtualMsg]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._client_ids = itertools.count()

    def connect(self, name: str, node: str) -> VirtualNatsClient:
        return VirtualNatsClient(self, name, node, next(self._client_ids))

    def add(self, sub: VirtualSubscription) -> None:
        if sub.is_wildcard:
            self._wildcards.append(sub)
        else:
            self._exact.setdefault(sub.subject, []).append(sub)

    def remove(self, sub: VirtualSubscription) -> None:
        if sub.is_wildcard:
            if sub in self._wildcards:
                self._wildcards.remove(sub)
            return
        subs = self._exact.get(sub.subject)
        if subs and sub in subs:
            subs.remove(sub)
            if not subs:
                del self._exact[sub.subject]

    def receivers(self, subject: str) -> list[VirtualSubscription]:
        """Every plain subscriber of `subject` and one member of each queue group (round robin)."""
        tokens = subject.split(".")
        matched = [*self._exact.get(subject, ()), *(s for s in self._wildcards if _matches(s.tokens, tokens))]
        if all(not s.queue for s in matched):
            return matched
        chosen = [s for s in matched if not s.queue]
        groups: dict[tuple[str, str], list[VirtualSubscription]] = {}
        for sub in matched:
            if sub.queue:
                groups.setdefault((sub.subject, sub.queue), []).append(sub)
        for key, members in groups.items():
            turn = next(self._groups.setdefault(key, itertools.count()))
            chosen.append(members[turn % len(members)])
        return chosen

    def publish(self, sender: VirtualNatsClient, subject: str, data: bytes, reply: str = "") -> int:
        """Send `data` to every receiver of `subject`; returns how many there are."""
        targets = self.receivers(subject)
        if not targets:
            return 0
        loop = asyncio.get_running_loop()
        now, size = loop.time(), wire_bytes(data)
        for sub in targets:
            at = self.network.arrival(sender.node, sub.client.node, size, now)
            at = max(at, sub.last_from.get(sender.id, 0.0))  # NATS keeps one publisher's messages in order
            sub.last_from[sender.id] = at
            heapq.heappush(self._due, (at, next(self._seq), sub, VirtualMsg(subject, reply, data, sub.client)))
        self._arm(loop)
        return len(targets)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        first = self._due[0][0]
        if self._timer is not None:
            if self._timer.when() <= first:
                return
            self._timer.cancel()
        self._timer = loop.call_at(first, self._deliver_due)

    def _deliver_due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._due and self._due[0][0] <= now + SAME_INSTANT_S:
            _, _, sub, msg = heapq.heappop(self._due)
            sub.put(msg)
        if self._due:
            self._arm(loop)


class VirtualNatsClient:
    """One service's connection (the parts of nats-py's `Client` that `Bus` uses)."""

    def __init__(self, server: VirtualNats, name: str, node: str, client_id: int) -> None:
        self.server, self.name, self.node, self.id = server, name, node, client_id
        self.max_payload = MAX_PAYLOAD
        self.is_closed = False
        self.options: dict[str, Any] = {}
        self.context: contextvars.Context | None = None  # what its subscriptions' handlers run in (log fields)
        self._subs: dict[int, VirtualSubscription] = {}
        self._inbox_ids = itertools.count()

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "") -> None:
        if self.is_closed:
            raise nats.errors.ConnectionClosedError
        if len(payload) > self.max_payload:
            raise nats.errors.MaxPayloadError
        self.server.publish(self, subject, payload, reply)

    async def subscribe(self, subject: str, queue: str = "",
                        cb: Callable[[VirtualMsg], Awaitable[None]] | None = None) -> VirtualSubscription:
        if cb is None:
            raise ValueError("a virtual subscription needs a callback")
        sub = VirtualSubscription(self.server, self, subject, queue, cb)
        self.server.add(sub)
        self._subs[id(sub)] = sub
        return sub

    def forget(self, sub: VirtualSubscription) -> None:
        self._subs.pop(id(sub), None)

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5) -> VirtualMsg:
        inbox = f"_INBOX.{self.id}.{next(self._inbox_ids)}"
        answer: asyncio.Future[VirtualMsg] = asyncio.get_running_loop().create_future()

        async def on_reply(msg: VirtualMsg) -> None:
            if not answer.done():
                answer.set_result(msg)

        sub = VirtualSubscription(self.server, self, inbox, "", on_reply)
        self.server.add(sub)
        try:
            if not self.server.publish(self, subject, payload, inbox):
                raise nats.errors.NoRespondersError
            try:
                return await asyncio.wait_for(answer, timeout)
            except TimeoutError:
                raise nats.errors.TimeoutError from None
        finally:
            sub.close()

    async def flush(self, timeout: float = 10.0) -> None:
        return None

    async def drain(self) -> None:
        await self.close()

    async def close(self) -> None:
        self.is_closed = True
        for sub in list(self._subs.values()):
            sub.close()


def _matches(pattern: list[str], tokens: list[str]) -> bool:
    for i, token in enumerate(pattern):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or (token != "*" and token != tokens[i]):
            return False
    return len(pattern) == len(tokens)


def wire_bytes(data: bytes) -> int:
    """The bytes a message stands for: its encoding, plus what a size-only payload in it stands for (read from the
    unpacked fields alone: the receiver's `decode` checks the message, this only sizes it)."""
    if _SIZE_ONLY_MARK not in data:
        return len(data)
    fields = unchecked_fields(data)
    if fields is None:  # not a message: the receiver says so; it stands for its bytes
        return len(data)
    stands_for = fields.get("raw_size", 0) if fields.get("codec") == CODEC_SIZE_ONLY else 0
    return len(data) + (stands_for if type(stands_for) is int and stands_for > 0 else 0)
