"""A decode instance's incoming hand-off streams: one `HandoffStream` per request, a stall deadline, and a budget of
the bytes they may hold, smaller for streams the scheduler did not announce (`ExpectHandoff`), so that KV nobody
asked for cannot fill the instance's memory. It sends nothing and never raises on a bad message: it reports it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from shared.wire.handoff.stream import HandoffStream
from shared.wire.parts import PartError
from shared.wire.protocol import FastGenProfilePart, HandoffEnd, HandoffStart, KvChunk

CLOSED_MEMORY = 10.0  # a closed request's late messages are ignored for this many deadlines
UNANNOUNCED_SHARE = 16  # streams nobody announced may hold 1/16 of the budget together
MAX_EXPECTED = 65536  # announcements remembered (the oldest go first)


class HandoffReceiver:
    """In-flight hand-off streams, with a stall deadline and a byte budget.

    A request whose stream failed, was closed or was taken is closed: its late messages are ignored silently for ten
    deadlines, so they neither reopen it nor later report a stall for it.

    Args:
        deadline_s: a stream with no new message for this long is expired.
        max_bytes: the most decoded bytes all streams may hold together; a part beyond it fails its stream.
            Streams of requests not announced with `expect` may hold `max_bytes // 16` together.
        expect_ttl_s: how long an announcement waits for its stream to start.
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(
        self, deadline_s: float, max_bytes: int = 1 << 40, expect_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deadline_s, self.max_bytes, self.expect_ttl_s, self.clock = deadline_s, max_bytes, expect_ttl_s, clock
        self._streams: dict[str, HandoffStream] = {}
        self._closed: dict[str, float] = {}  # request_id -> when it was closed
        self._expected: OrderedDict[str, float] = OrderedDict()  # announced request_id -> when
        self.num_held_bytes = 0
        self.num_unannounced_bytes = 0

    def expect(self, request_id: str) -> None:
        """The scheduler placed this request here: its stream may use the whole budget."""
        stream = self._streams.get(request_id)
        if stream is not None and request_id not in self._expected:  # the stream came first (across a NATS cluster)
            self.num_unannounced_bytes -= stream.num_held_bytes
        self._expected[request_id] = self.clock()
        self._expected.move_to_end(request_id)
        while len(self._expected) > MAX_EXPECTED:
            self._forget_expected(next(iter(self._expected)))

    def is_expected(self, request_id: str) -> bool:
        return request_id in self._expected

    def start(self, msg: HandoffStart) -> PartError | None:
        """Open the request's stream; an identical repeat is ignored. Returns the error that failed it, else None."""
        request_id = msg.request_id
        if request_id in self._closed:
            return None
        stream = self._streams.get(request_id)
        if stream is not None:
            if stream.start == msg:
                return None
            return self._fail(request_id, PartError(f"request {request_id}: its hand-off started twice, differently"))
        try:
            self._streams[request_id] = HandoffStream(msg, self.clock)
        except PartError as exc:
            return self._fail(request_id, exc)
        return None

    def add(self, part: KvChunk | FastGenProfilePart) -> PartError | None:
        """Take one KV chunk or profile part into its stream. Returns the error that failed the stream, else None."""
        request_id = part.request_id
        if request_id in self._closed:
            return None
        stream = self._streams.get(request_id)
        if stream is None:
            return self._fail(request_id, PartError(f"request {request_id}: a {part.KIND} before its hand-off "
                                                    "started (the start was lost?)"))
        held_before = stream.num_held_bytes
        try:
            self._check_budget(request_id, part.raw_size)
            stream.add(part)
        except PartError as exc:
            return self._fail(request_id, exc)
        self._count(request_id, stream.num_held_bytes - held_before)
        return None

    def end(self, msg: HandoffEnd) -> tuple[HandoffStream | None, PartError | None]:
        """The stream's last message: (the whole stream, taken and closed, None), or (None, the error that failed
        it), or (None, None) for a stream closed before."""
        request_id = msg.request_id
        if request_id in self._closed:
            return None, None
        stream = self._streams.get(request_id)
        if stream is None:
            return None, self._fail(request_id, PartError(f"request {request_id}: its hand-off ended before it "
                                                          "started (the start was lost?)"))
        try:
            stream.finish(msg)
        except PartError as exc:
            return None, self._fail(request_id, exc)
        self.close(request_id)
        return stream, None

    def _check_budget(self, request_id: str, num_bytes: int) -> None:
        if self.num_held_bytes + num_bytes > self.max_bytes:
            raise PartError(f"request {request_id}: decode's KV buffer is full ({self.max_bytes >> 20} MiB)")
        limit = self.max_bytes // UNANNOUNCED_SHARE
        if request_id not in self._expected and self.num_unannounced_bytes + num_bytes > limit:
            raise PartError(f"request {request_id}: KV for a request the scheduler did not place here "
                            f"(beyond {limit >> 20} MiB of such KV)")

    def _count(self, request_id: str, num_bytes: int) -> None:
        self.num_held_bytes += num_bytes
        if request_id not in self._expected:
            self.num_unannounced_bytes += num_bytes

    def expire(self) -> list[tuple[str, str]]:
        """Close every stream without a new message for `deadline_s` since its first KV chunk (or without any
        KV for `expect_ttl_s`: a stream opens when prefill admits its request, and the request may then wait in
        prefill's queue), and forget announcements older than `expect_ttl_s`.

        Returns:
            (request_id, reason) for each stream, e.g. "hand-off stalled: 5 of 12 KV chunks missing after 10.0 s".
        """
        expired = []
        for request_id, stream in list(self._streams.items()):
            idle_s = stream.stalled_s()
            if not stream.has_begun:  # queued at prefill, which may take long under load: only the request's limit
                if idle_s >= self.expect_ttl_s:
                    expired.append((request_id, f"hand-off never began: no KV after {idle_s:.1f} s"))
                    self.close(request_id)
            elif idle_s >= self.deadline_s:
                expired.append((request_id, f"hand-off stalled: {stream.describe_stall()} after {idle_s:.1f} s"))
                self.close(request_id)
        now = self.clock()
        forget_before = now - CLOSED_MEMORY * self.deadline_s
        self._closed = {rid: at for rid, at in self._closed.items() if at >= forget_before}
        while self._expected and next(iter(self._expected.values())) < now - self.expect_ttl_s:
            self._forget_expected(next(iter(self._expected)))
        return expired

    def _forget_expected(self, request_id: str) -> None:
        """Drop an announcement; a stream it covered counts as unannounced from now on."""
        del self._expected[request_id]
        stream = self._streams.get(request_id)
        if stream is not None:
            self.num_unannounced_bytes += stream.num_held_bytes

    def is_closed(self, request_id: str) -> bool:
        """The request's stream failed, was closed or taken (recently: see the class doc)."""
        return request_id in self._closed

    def close(self, request_id: str) -> None:
        """Drop the request's stream, if any, and its announcement; its later messages are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._count(request_id, -stream.num_held_bytes)
        self._expected.pop(request_id, None)
        self._closed[request_id] = self.clock()

    def _fail(self, request_id: str, error: PartError) -> PartError:
        self.close(request_id)
        return error

    def request_ids(self) -> list[str]:
        """The requests whose hand-off is arriving (for the heartbeat: an instance lists everything it holds)."""
        return list(self._streams)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)
