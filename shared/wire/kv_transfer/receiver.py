"""A decode instance's incoming KV streams: one `KvAssembly` per request, a stall deadline, and a budget of the bytes
they may hold, smaller for streams the scheduler did not announce (`ExpectHandoff`), so that KV nobody asked for
cannot fill the instance's memory. It sends nothing and never raises on a bad chunk: it reports it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from shared.wire.kv_transfer.chunks import KvAssembly, KvTransferError
from shared.wire.protocol import KvChunk

CLOSED_MEMORY = 10.0  # a closed request's late chunks are ignored for this many deadlines
UNANNOUNCED_SHARE = 16  # streams nobody announced may hold 1/16 of the budget together
MAX_EXPECTED = 65536  # announcements remembered (the oldest go first)


class KvReceiver:
    """In-flight KV streams, with a stall deadline and a byte budget.

    A request whose transfer failed, was discarded or was taken is closed: its late chunks are ignored silently for
    ten deadlines, so they neither reopen it nor later report a stall for it.

    Args:
        deadline_s: a stream with no new chunk for this long is expired.
        max_bytes: the most decompressed bytes all streams may hold together; a chunk beyond it fails its stream.
            Streams of requests not announced with `expect` may hold `max_bytes // 16` together.
        expect_ttl_s: how long an announcement waits for its stream to start.
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(
        self, deadline_s: float, max_bytes: int = 1 << 40, expect_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deadline_s, self.max_bytes, self.expect_ttl_s, self.clock = deadline_s, max_bytes, expect_ttl_s, clock
        self._assemblies: dict[str, KvAssembly] = {}
        self._last_seen: dict[str, float] = {}
        self._closed: dict[str, float] = {}  # request_id -> when it was closed
        self._expected: OrderedDict[str, float] = OrderedDict()  # announced request_id -> when
        self.num_held_bytes = 0
        self.num_unannounced_bytes = 0

    def expect(self, request_id: str) -> None:
        """The scheduler placed this request here: its stream may use the whole budget."""
        assembly = self._assemblies.get(request_id)
        if assembly is not None and request_id not in self._expected:  # chunks came first (across a NATS cluster)
            self.num_unannounced_bytes -= assembly.num_held_bytes
        self._expected[request_id] = self.clock()
        self._expected.move_to_end(request_id)
        while len(self._expected) > MAX_EXPECTED:
            self._forget_expected(next(iter(self._expected)))

    def is_expected(self, request_id: str) -> bool:
        return request_id in self._expected

    def add(self, chunk: KvChunk) -> KvTransferError | None:
        """Take one chunk (opening the request's assembly on its first); never raises.

        Returns:
            the error that failed this request (its assembly is then dropped), else None.
        """
        request_id = chunk.request_id
        if request_id in self._closed:
            return None
        now = self.clock()
        try:
            self._check_budget(request_id, chunk.raw_size)
            assembly = self._assemblies.get(request_id)
            if assembly is None:
                assembly = KvAssembly(request_id, chunk.total)
            held_before = assembly.num_held_bytes
            assembly.add(chunk)
        except KvTransferError as exc:
            self._close(request_id, now)
            return exc
        self._assemblies[request_id] = assembly
        self._count(request_id, assembly.num_held_bytes - held_before)
        self._last_seen[request_id] = now
        return None

    def _check_budget(self, request_id: str, num_bytes: int) -> None:
        if self.num_held_bytes + num_bytes > self.max_bytes:
            raise KvTransferError(f"request {request_id}: decode's KV buffer is full ({self.max_bytes >> 20} MiB)")
        limit = self.max_bytes // UNANNOUNCED_SHARE
        if request_id not in self._expected and self.num_unannounced_bytes + num_bytes > limit:
            raise KvTransferError(f"request {request_id}: KV for a request the scheduler did not place here "
                                  f"(beyond {limit >> 20} MiB of such KV)")

    def _count(self, request_id: str, num_bytes: int) -> None:
        self.num_held_bytes += num_bytes
        if request_id not in self._expected:
            self.num_unannounced_bytes += num_bytes

    def take_complete(self, request_id: str) -> KvAssembly | None:
        """Pop the request's assembly if all its chunks are in, else None (and keep it)."""
        assembly = self._assemblies.get(request_id)
        if assembly is None or not assembly.is_complete:
            return None
        self._close(request_id, self.clock())
        return assembly

    def is_complete(self, request_id: str) -> bool:
        assembly = self._assemblies.get(request_id)
        return assembly is not None and assembly.is_complete

    def expire(self) -> list[tuple[str, str]]:
        """Drop every stream without a new chunk for `deadline_s`, and announcements older than `expect_ttl_s`.

        Returns:
            (request_id, reason) for each stream, e.g. "KV transfer stalled: 5 of 12 chunks missing after 10.0 s".
        """
        now = self.clock()
        expired = []
        for request_id, seen in list(self._last_seen.items()):
            idle_s = now - seen
            if idle_s < self.deadline_s:
                continue
            assembly = self._assemblies[request_id]
            if assembly.is_complete:
                reason = f"KV transfer complete but not taken after {idle_s:.1f} s"
            else:
                num_missing = assembly.total - assembly.num_received
                reason = f"KV transfer stalled: {num_missing} of {assembly.total} chunks missing after {idle_s:.1f} s"
            expired.append((request_id, reason))
            self._close(request_id, now)
        forget_before = now - CLOSED_MEMORY * self.deadline_s
        self._closed = {rid: at for rid, at in self._closed.items() if at >= forget_before}
        while self._expected and next(iter(self._expected.values())) < now - self.expect_ttl_s:
            self._forget_expected(next(iter(self._expected)))
        return expired

    def _forget_expected(self, request_id: str) -> None:
        """Drop an announcement; a stream it covered counts as unannounced from now on."""
        del self._expected[request_id]
        assembly = self._assemblies.get(request_id)
        if assembly is not None:
            self.num_unannounced_bytes += assembly.num_held_bytes

    def is_closed(self, request_id: str) -> bool:
        """The request's stream failed, was discarded or taken (recently: see the class doc)."""
        return request_id in self._closed

    def discard(self, request_id: str) -> None:
        """Drop the request's stream (cancellation); its later chunks are ignored."""
        self._close(request_id, self.clock())

    def request_ids(self) -> list[str]:
        """The requests whose KV is arriving (for the heartbeat: an instance lists everything it holds)."""
        return list(self._assemblies)

    def _close(self, request_id: str, now: float) -> None:
        assembly = self._assemblies.pop(request_id, None)
        if assembly is not None:
            self._count(request_id, -assembly.num_held_bytes)
        self._expected.pop(request_id, None)
        self._last_seen.pop(request_id, None)
        self._closed[request_id] = now

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._assemblies

    def __len__(self) -> int:
        return len(self._assemblies)
