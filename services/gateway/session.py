"""One request's life on the backend: open its stream, submit, relay its events in `index` order, place it again
when the instance holding it is lost (mid-answer: the tokens the client has become the end of its prompt, and the
answer goes on from the next), and always clean up (cancel what did not finish, close the stream). HTTP framing is
app.py's job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from services.gateway.backend import Backend, BackendUnavailable, EventStream
from services.gateway.errors import for_status, from_error_type, timed_out, unavailable
from services.gateway.metrics import RequestTimer
from services.gateway.progress import ProgressWatch, Verdict
from shared.wire.log import get_logger
from shared.wire.protocol import ErrorType, StreamEvent, SubmitRequest

log = get_logger(__name__)
MAX_BUFFERED_EVENTS = 4096  # out-of-order events held back; more means a publisher is broken
MIN_WAIT_S = 0.01  # a wait of 0 would not even look at events already queued
# A stream has one writer at a time (prefill until the request's hand-off ends, decode from then on), so its events
# come in order unless one is lost in transit (a NATS restart); later ones held back this long mean it will never come.
STREAM_GAP_S = 5.0
SCHEDULER_RETRY_S = (0.05, 0.5)  # between submits while no scheduler answers: the first wait, the longest
# Failures of where the request ran, not of the request: the instance holding it was lost (or cancelled it because
# another was), or its prompt's KV did not reach decode. Placed again, it goes on from the last token the client has.
PLACE_AGAIN_ON = (ErrorType.UNAVAILABLE, ErrorType.KV_TRANSFER)
Hasher = Callable[[list[int]], list[int]]  # a prompt's block hashes, as the gateway names its full blocks


@dataclass(frozen=True)
class Deadlines:
    """How long a request may go quiet (progress.py): `progress_timeout_s` while no instance holds it (503),
    `request_timeout_s` in any case (504); and how long its submission may wait for a scheduler that does not answer
    (one restarting: its supervisor brings it back within a few seconds), `scheduler_wait_s`, before a 503."""

    request_timeout_s: float = 300.0
    progress_timeout_s: float = 15.0
    scheduler_wait_s: float = 0.0


@dataclass(frozen=True)
class Delta:
    """What one in-order event adds to the answer."""

    text: str
    num_tokens: int
    finish_reason: str | None


class Reorderer:
    """Releases `StreamEvent`s in `index` order; failures pass at once, duplicates of released tokens are dropped.

    At one index a token-less event (trailing text, a bare finish) goes before the tokens that start there.

    Args:
        clock: monotonic seconds, for how long a gap has held events back (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.next_index = 0
        self._heap: list[tuple[int, bool, int, StreamEvent]] = []
        self._arrival = itertools.count()
        self.clock = clock
        self._gap_since: float | None = None  # when events began to wait for a gap before them

    def gap_s(self) -> float:
        """How long events have waited for an earlier one that has not come (0: none wait)."""
        return 0.0 if self._gap_since is None else self.clock() - self._gap_since

    def push(self, event: StreamEvent) -> list[StreamEvent]:
        """Raises ApiError (500) when too many events wait for a gap that never fills."""
        if event.error_type:
            return [event]
        if event.token_ids and event.index < self.next_index:
            log.warning("dropped a duplicate stream event", request_id=event.request_id, index=event.index)
            return []
        heapq.heappush(self._heap, (event.index, bool(event.token_ids), next(self._arrival), event))
        if len(self._heap) > MAX_BUFFERED_EVENTS:
            raise for_status(500, f"stream events out of order past index {self.next_index}")
        ready = []
        while self._heap and self._heap[0][0] <= self.next_index:
            ready_event = heapq.heappop(self._heap)[3]
            if ready_event.token_ids and ready_event.index < self.next_index:
                continue  # a duplicate that arrived while its first copy was still buffered
            ready.append(ready_event)
            self.next_index += len(ready_event.token_ids)
        if not self._heap:
            self._gap_since = None
        elif ready or self._gap_since is None:
            self._gap_since = self.clock()
        return ready


class Session:
    """Drives one request through a `Backend`; use as `async with Session(...) as s: await s.next_delta()`.

    Args:
        backend: the cluster.
        request: what to submit.
        deadlines: how long the stream may go quiet: lost (503) or silent (504).
        timer: records TTFT, inter-token and end-to-end latency.
        migration_limit: how many times a request whose instance was lost is placed again (as `<request id>-r<n>`,
            with a stream of its own); past it, the failure reaches the client.
        hasher: the block hashes of a prompt; without it, a request is placed again only before its first token.
    Raises (on entry):
        ApiError: rejected (429 + Retry-After), no scheduler or no instance (503), or another reported failure.
    """

    def __init__(self, backend: Backend, request: SubmitRequest, deadlines: Deadlines, timer: RequestTimer,
                 migration_limit: int = 0, hasher: Hasher | None = None) -> None:
        self.backend, self.request, self.deadlines, self.timer = backend, request, deadlines, timer
        self.first_request = request  # its id is the gateway's: the response's, and every log line's prefix
        self.hasher = hasher
        self.output_ids: list[int] = []  # every token the client has been sent
        self.request_id = request.request_id  # the backend's id of the current placement
        self.migration_limit = migration_limit
        self.num_placements = 0  # after the first: times it was placed again
        self.watch: ProgressWatch | None = None
        self.is_accepted = False
        self.reorderer = Reorderer()
        self.stream: EventStream | None = None
        self.ready: list[StreamEvent] = []
        self.is_done = False  # finished normally, or never accepted: nothing to cancel
        self.cancel_reason: str | None = None  # why we cancel, when the caller knows better than the exception
        self.num_prompt_tokens = len(request.prompt_ids)
        self.num_cached_tokens = 0
        self.kv_bytes_saved = 0  # FastGen's figure for this request, from decode (0: it kept every token)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_moved_tokens(self) -> int:
        """Of the tokens the client has, those the current placement has as the end of its prompt."""
        return len(self.request.prompt_ids) - len(self.first_request.prompt_ids)

    async def __aenter__(self) -> Session:
        self.stream = await self.backend.open_stream(self.request_id)
        try:
            await self._submit()
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def _submit(self) -> None:
        give_up_at = time.monotonic() + self.deadlines.scheduler_wait_s
        pause_s, longest_s = SCHEDULER_RETRY_S
        while True:
            try:
                reply = await self.backend.submit(self.request)
                break
            except BackendUnavailable as exc:
                if time.monotonic() + pause_s > give_up_at:
                    log.warning("scheduler did not answer", request_id=self.request_id, error=str(exc))
                    raise unavailable("the scheduler is not answering; try again later") from None
                await asyncio.sleep(pause_s)  # a restarting one comes back within seconds
                pause_s = min(2 * pause_s, longest_s)
        if not reply.accepted:
            self.is_done = True
            log.info("not accepted", request_id=self.request_id, error_type=reply.error_type, reason=reply.reason)
            self.timer.metrics.rejections.inc(reason=reply.reason_code or reply.error_type or "unknown")
            error_type = reply.error_type or ErrorType.UNAVAILABLE
            raise from_error_type(error_type, reply.reason, reply.retry_after_s)
        self.is_accepted = True
        self.watch = ProgressWatch(self.deadlines.progress_timeout_s, self.deadlines.request_timeout_s)
        log.info("accepted", request_id=self.request_id, prefill=reply.prefill_id, decode=reply.decode_id)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if not self.is_done:
                reason = self.cancel_reason or _cancel_reason(exc)
                log.info("cancelling", request_id=self.request_id, reason=reason)
                await self.backend.cancel(self.request_id, reason)
        finally:
            if self.stream is not None:
                stream, self.stream = self.stream, None
                await stream.close()

    async def next_delta(self) -> Delta:
        """The next piece of the answer, in order; the last one has `finish_reason` set.

        Raises:
            ApiError: a failure event (status by its `ErrorType`), an aborted or lost request (503), or silence
                (504).
        """
        while True:
            while not self.ready:
                self.ready = await self._next_in_order()
            event = self.ready.pop(0)
            if self._may_place_again(event):
                await self._place_again(event)
                continue
            delta = self._apply(event)
            if delta is not None:
                return delta

    def _may_place_again(self, event: StreamEvent) -> bool:
        done = self.num_output_tokens
        return (event.error_type in PLACE_AGAIN_ON and self.num_placements < self.migration_limit
                and (not done or (self.hasher is not None and done < self.first_request.sampling.max_tokens)))

    async def _place_again(self, failure: StreamEvent) -> None:
        """The request failed where it ran, not for what it asks: submit it again under a new id, on a stream of
        its own (late events of the failed placement go nowhere). Mid-answer, the tokens the client has end its
        prompt (the scheduler finds their KV where it is cached) and it asks for the rest: `max_tokens` and
        `min_tokens` less those, seeded draws from their position on (`SamplingParams.output_offset`). Not carried
        over: a stop string begun before the move and ended after it, and the bytes of a character split across the
        move (byte-level tokenizers only split characters outside ASCII).

        Raises:
            ApiError: the scheduler refuses it now (429, 503) or does not answer (503).
        """
        assert self.stream is not None
        self.num_placements += 1
        failed_id = self.request_id
        self.request_id = f"{self.first_request.request_id}-r{self.num_placements}"
        done = self.num_output_tokens
        log.warning("placing the request again", request_id=failed_id, new_request_id=self.request_id,
                    placement=self.num_placements + 1, tokens_sent=done, error_type=failure.error_type,
                    error=failure.error)
        await self.backend.cancel(failed_id, "placed again")  # whatever survives of it stops
        stream, self.stream = self.stream, None
        await stream.close()
        self.stream = await self.backend.open_stream(self.request_id)
        self.request = self._rest_of(self.request_id, done)
        self.reorderer, self.ready = Reorderer(), []
        self.timer.metrics.placed_again.inc(stage="mid_answer" if done else "before_first_token")
        await self._submit()

    def _rest_of(self, request_id: str, done: int) -> SubmitRequest:
        """The first request under `request_id`, less the `done` tokens the client has (they end its prompt)."""
        first = dataclasses.replace(self.first_request, request_id=request_id, num_placed_before=self.num_placements)
        if not done:
            return first
        assert self.hasher is not None
        prompt = [*first.prompt_ids, *self.output_ids]
        sampling = dataclasses.replace(first.sampling, max_tokens=first.sampling.max_tokens - done,
                                       min_tokens=max(first.sampling.min_tokens - done, 0), output_offset=done)
        return dataclasses.replace(first, prompt_ids=prompt, block_hashes=self.hasher(prompt), sampling=sampling)

    async def _next_in_order(self) -> list[StreamEvent]:
        assert self.stream is not None and self.watch is not None, "use Session inside `async with`"
        while True:
            event = await self.stream.next_event(max(MIN_WAIT_S, self.watch.wait_s()))
            if event is not None:
                self.watch.saw_event()
                ready = self.reorderer.push(event)
                if ready or self.reorderer.gap_s() < STREAM_GAP_S:
                    return ready
            if self.reorderer.gap_s() >= STREAM_GAP_S:
                log.warning("stream events lost", request_id=self.request_id, next_index=self.reorderer.next_index)
                self.cancel_reason = "stream events lost"
                raise for_status(502, f"tokens of the answer from index {self.reorderer.next_index} were lost in "
                                      "transit (a NATS restart?); later ones arrived")
            if self._is_held():
                self.watch.saw_held()
            verdict = self.watch.verdict()
            if verdict is Verdict.LOST:
                timeout_s = self.deadlines.progress_timeout_s
                log.warning("request lost: no event and no instance holds it", request_id=self.request_id,
                            timeout_s=timeout_s)
                self.cancel_reason = "lost"
                raise unavailable(f"the request was lost: no progress for {timeout_s:g} s and no instance holds it")
            if verdict is Verdict.SILENT:
                timeout_s = self.deadlines.request_timeout_s
                log.warning("stream went silent", request_id=self.request_id, timeout_s=timeout_s)
                self.cancel_reason = "timeout"
                raise timed_out(timeout_s)

    def _is_held(self) -> bool:
        """Does a live instance's latest heartbeat list the request (queued, computing, waiting or running)?"""
        return any(self.request_id in beat.request_ids for beat in self.backend.instances())

    def _apply(self, event: StreamEvent) -> Delta | None:
        if event.error_type:
            log.warning("request failed", request_id=self.request_id, error_type=event.error_type, error=event.error)
            raise from_error_type(event.error_type, event.error)
        if event.finish_reason == "abort":
            raise unavailable("the request was aborted by the server")
        # Usage counts the client's prompt and what the client received: not the tokens a placement mid-answer
        # has as the end of its prompt.
        num_prompt_tokens = event.num_prompt_tokens - self.num_moved_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, min(event.num_cached_tokens, num_prompt_tokens))
        self.kv_bytes_saved = event.kv_bytes_saved or self.kv_bytes_saved  # the latest decode figure
        self.num_prompt_tokens = max(self.num_prompt_tokens, num_prompt_tokens)
        self.output_ids += event.token_ids
        self.timer.tokens(len(event.token_ids))
        if event.finish_reason:
            self.is_done = True
            self.timer.finished(self.num_prompt_tokens, self.num_cached_tokens)
            log.info("finished", request_id=self.request_id, finish_reason=event.finish_reason,
                     num_output_tokens=self.num_output_tokens, num_cached_tokens=self.num_cached_tokens)
        if not (event.token_ids or event.text or event.finish_reason):
            return None
        return Delta(event.text, len(event.token_ids), event.finish_reason or None)


def _cancel_reason(exc: BaseException | None) -> str:
    if isinstance(exc, asyncio.CancelledError | ConnectionError):
        return "client disconnected"
    return "gateway gave up on the request"
