"""The NATS connection every service uses: connect with reconnect, typed publish/request, typed handlers (with queue
groups), refusals logged without flooding. The service lifecycle around it is `services.common.lifecycle`.

Messages and subjects come from `shared.wire.protocol`; this module only moves them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.wire.log import get_logger, redact_url
from shared.wire.nats_auth import NatsAuthError, NatsCredentials
from shared.wire.protocol import Ack, Message, ProtocolError, Subjects, decode, encode

log = get_logger(__name__)
T = TypeVar("T", bound=Message)
Handler = Callable[[Any], Awaitable[Message | None]]
NO_RESPONDERS_GRACE_S = 0.25  # how long a request waits for a responder the server does not see yet
DROP_LOG_S = 5.0  # refused messages are logged at most this often per subject
MAX_DROP_SUBJECTS = 4096


class BusError(RuntimeError):
    """A request got no answer in time, or an error answer."""


class Bus:
    """A connected NATS client speaking tsukimi messages.

    Args:
        client: a connected nats-py client.
        subjects: the subject names under this deployment's prefix.
    """

    def __init__(self, client: Client, subjects: Subjects, events: _ConnectionEvents | None = None) -> None:
        self.client = client
        self.subjects = subjects
        self._events = events or _ConnectionEvents()
        self._drops = DropLog()

    @classmethod
    async def connect(
        cls, url: str, name: str, subjects: Subjects, credentials: NatsCredentials | None = None,
        connect_timeout_s: float = 10.0,
    ) -> Bus:
        """Connect (retrying while the server starts) and keep reconnecting forever after a disconnect.

        Args:
            credentials: user, password, reply-subject prefix and TLS (None: anonymous, `_INBOX` replies).
        Raises:
            BusError: no server answered within `connect_timeout_s`, or it refused the credentials (at once: asking
                again with the same ones cannot help).
        """
        credentials = credentials or NatsCredentials()
        try:
            tls = credentials.tls_context()
        except NatsAuthError as exc:
            raise BusError(str(exc)) from None
        events = _ConnectionEvents()
        servers = [s.strip() for s in url.split(",") if s.strip()]
        deadline = asyncio.get_running_loop().time() + connect_timeout_s
        while True:
            try:
                # Not reconnecting on the first connect: nats-py would then retry a refused password forever
                # itself; this loop retries a server that is not up yet, and says why it gave up.
                client = await nats.connect(
                    servers, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=2,
                    allow_reconnect=False, error_cb=events.on_error, disconnected_cb=events.on_disconnect,
                    reconnected_cb=events.on_reconnect, user=credentials.user or None,
                    password=credentials.password or None, inbox_prefix=credentials.inbox, tls=tls,
                )
                client.options["allow_reconnect"] = True  # from now on, every disconnect reconnects
                return cls(client, subjects, events)
            except Exception as exc:  # nats raises several unrelated types while the server starts
                where = redact_url(url)
                if "authorization violation" in str(exc).lower():
                    who = f"user {credentials.user!r}" if credentials.user else "no credentials"
                    raise BusError(f"NATS at {where} refused {who}: check TSUKIMI_NATS_USER and its password") from None
                if asyncio.get_running_loop().time() > deadline:
                    raise BusError(f"cannot connect to NATS at {where}: {exc}") from None
                await asyncio.sleep(0.2)

    @property
    def max_payload(self) -> int:
        return int(self.client.max_payload)

    async def publish(self, subject: str, msg: Message) -> None:
        await self.client.publish(subject, encode(msg))

    async def request(
        self, subject: str, msg: Message, expected: type[T], timeout_s: float = 2.0,
        responder_grace_s: float = NO_RESPONDERS_GRACE_S,
    ) -> T:
        """Send and wait for the typed reply; while the server says nobody listens, ask again for `responder_grace_s`
        (0: an absent responder fails at once, for lookups that do without an answer).

        Raises:
            BusError: no responder, a timeout, an `Ack` carrying an error, or a reply of another type.
        """
        reply = await self._request_raw(subject, encode(msg), timeout_s, responder_grace_s)
        try:
            answer = decode(reply.data)
        except ProtocolError as exc:
            raise BusError(f"bad answer on {subject}: {exc}") from None
        if isinstance(answer, Ack) and not answer.ok:
            raise BusError(f"{subject}: {answer.error}")
        if not isinstance(answer, expected):
            raise BusError(f"{subject}: expected {expected.KIND}, got {answer.KIND}")
        return answer

    async def serve(
        self, subject: str, handler: Handler, queue: str = "", kinds: tuple[type[Message], ...] = (),
        bind_sender: bool = False,
    ) -> Subscription:
        """Call `handler(message)` for each message on `subject`; a returned message answers a request.

        Args:
            kinds: the message types this subject carries; any other kind is refused before the handler sees it.
            bind_sender: the subject ends in `<role>.<instance_id>` (`Subjects.sender_of`) and the message's own
                `instance_id` (and `role`, where it has one) must be those: NATS permissions bind a role's credentials
                to its subjects, this binds the message to the subject.
        Refused messages (undecodable, of another kind, or speaking for another sender) are dropped, answered with
        an error `Ack` when a reply is expected, and logged at most once per `DROP_LOG_S` per subject with a count;
        a handler that raises is logged, never kills the subscription.
        """

        async def on_msg(raw: Msg) -> None:
            try:
                msg = decode(raw.data)
                why = self._refusal(raw.subject, msg, kinds, bind_sender)
            except ProtocolError as exc:
                why = str(exc)
            if why:
                self._drops.note(raw.subject, why)
                if raw.reply:
                    await self._respond(raw, Ack(ok=False, error=why))
                return
            try:
                answer = await handler(msg)
            except Exception as exc:
                log.exception("handler failed", subject=raw.subject, kind=msg.KIND)
                answer = Ack(ok=False, error=f"{type(exc).__name__}: {exc}") if raw.reply else None
            if raw.reply and answer is not None:
                await self._respond(raw, answer)

        sub = await self.client.subscribe(subject, queue=queue, cb=on_msg)
        await self.client.flush()  # the server knows the subscription before we say we serve
        return sub

    async def route(
        self, subject: str, routes: Mapping[type[Message], Handler], queue: str = "", bind_sender: bool = False
    ) -> Subscription:
        """`serve` with a handler per message kind: each message goes to the handler of its kind, any other kind is
        refused (an endpoint's kinds and handlers declared in one place)."""

        async def dispatch(msg: Message) -> Message | None:
            return await routes[type(msg)](msg)

        return await self.serve(subject, dispatch, queue, tuple(routes), bind_sender)

    def _refusal(self, subject: str, msg: Message, kinds: tuple[type[Message], ...], bind_sender: bool) -> str:
        """Why `msg` may not be handled as a message on `subject`, or "" when it may."""
        if kinds and not isinstance(msg, kinds):
            return f"{msg.KIND} is not a message of this subject (expected {', '.join(k.KIND for k in kinds)})"
        if not bind_sender:
            return ""
        sender = self.subjects.sender_of(subject)
        claimed = (getattr(msg, "role", None), getattr(msg, "instance_id", None))
        if sender is None or claimed[1] != sender[1] or claimed[0] not in (None, sender[0]):
            return f"{msg.KIND} speaks for {claimed[0]}/{claimed[1]}, its subject for {sender}"
        return ""

    @staticmethod
    async def _respond(raw: Msg, answer: Message) -> None:
        try:
            await raw.respond(encode(answer))
        except Exception as exc:  # permissions or a closed connection: the requester times out
            log.warning("answer not sent", subject=raw.subject, error=str(exc))

    async def _request_raw(self, subject: str, payload: bytes, timeout_s: float, grace_s: float) -> Msg:
        """One request, asked again while the server says nobody listens, for at most `grace_s`.

        A subscription another connection has just flushed can still be invisible to this connection's publish for a
        moment on a busy server (nats-io/nats-server#2876); a responder that is starting up is not a missing one.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        grace_ends = loop.time() + min(grace_s, timeout_s)
        pause_s = 0.01
        while True:
            try:
                return await self.client.request(subject, payload, timeout=max(deadline - loop.time(), 0.001))
            except nats.errors.NoRespondersError:
                if loop.time() + pause_s > grace_ends:
                    raise BusError(f"no answer on {subject}: NoRespondersError") from None
            except nats.errors.TimeoutError:
                raise BusError(f"no answer on {subject}: TimeoutError") from None
            await asyncio.sleep(pause_s)
            pause_s *= 2

    async def drain(self) -> None:
        """Finish pending handlers, flush, and close."""
        self._events.draining = True
        if not self.client.is_closed:
            try:
                await self.client.drain()
            except Exception as exc:  # a dead server must not block shutdown
                log.warning("drain failed", error=str(exc))


class DropLog:
    """Counts refused messages (or errors) per subject (or kind) and logs them at most once per `interval_s` each: a
    flood of forged or broken messages must not flood the logs too.

    Args:
        interval_s: the shortest time between two log lines of one subject.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, interval_s: float = DROP_LOG_S, clock: Callable[[], float] = time.monotonic,
                 event: str = "refused a message") -> None:
        self.interval_s, self.clock, self.event = interval_s, clock, event
        self.counts: dict[str, int] = {}  # subject -> refused since start
        self._logged: dict[str, tuple[float, int]] = {}  # subject -> (when last logged, count then)

    def note(self, subject: str, why: str) -> None:
        self.counts[subject] = self.counts.get(subject, 0) + 1
        now = self.clock()
        last_at, last_count = self._logged.get(subject, (-math.inf, 0))
        if now - last_at >= self.interval_s:
            since = self.counts[subject] - last_count
            log.warning(self.event, subject=subject, reason=why, times_since_last_line=since)
            self._logged[subject] = (now, self.counts[subject])
        if len(self._logged) > MAX_DROP_SUBJECTS:  # per-request subjects would grow it forever
            self._logged.clear()
            self.counts.clear()


class _ConnectionEvents:
    """Logs what happens to the connection (a repeated error at most once per `DROP_LOG_S`); quiet about the
    disconnect that `drain` causes on purpose."""

    def __init__(self) -> None:
        self.draining = False
        self._errors = DropLog(event="nats error")

    async def on_error(self, exc: Exception) -> None:
        self._errors.note(type(exc).__name__, str(exc))

    async def on_disconnect(self) -> None:
        if not self.draining:
            log.warning("nats disconnected")

    async def on_reconnect(self) -> None:
        log.info("nats reconnected")
