"""The decode service: receives each request's hand-off stream from prefill (its header, the prompt's KV in verified
chunks, any FastGen profile, its end with the first token), writes the request's response stream from the first token
on, and joins the request to its continuous batch. A stalled or corrupt hand-off fails only its own request.

It computes prompts only when the scheduler sends one here (conditional disaggregation) and trusts no KV that did
not pass its checksum.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass

from services.common.engine_host import EngineHost
from services.common.step_samples import StepSamples
from services.common.tasks import BackgroundTasks
from services.common.warmup import time_decode_steps, time_prefill_steps
from services.decode.token_gaps import TokenGaps
from shared.config import EngineSettings
from shared.engine.engine import EngineFull, LLMEngine, PrefilledRequest, RequestOutput
from shared.engine.kv.store import PromptKv
from shared.engine.sequence import FinishReason
from shared.wire.bus import Bus, Handler
from shared.wire.handoff.profile import profile_of
from shared.wire.handoff.prompt import assemble_prompt
from shared.wire.handoff.receiver import HandoffReceiver
from shared.wire.handoff.stream import HandoffStream
from shared.wire.heartbeat import HeartbeatSender, Load
from shared.wire.log import get_logger
from shared.wire.parts import PartError
from shared.wire.protocol import (
    Cancel,
    ErrorType,
    ExpectHandoff,
    FastGenProfilePart,
    HandoffEnd,
    HandoffStart,
    KvChunk,
    Message,
    PrefillTask,
    Role,
    SamplingParams,
    StreamEvent,
)

log = get_logger(__name__)


@dataclass(frozen=True)
class _Failure:
    """A request the engine thread could not take (delivered as an error event)."""

    request_id: str
    error: str
    error_type: ErrorType = ErrorType.INVALID


@dataclass(frozen=True)
class _Tick:
    """One tick's results for the event loop, which delivers them while the next tick runs: what the next tick
    changes (the time its tokens were made, the aborts it applied) is not this one's."""

    results: list[RequestOutput | _Failure]
    tokens_ready_at: float  # when this tick's step made its tokens
    aborted: tuple[str, ...]  # cancellations this tick applied: delivered after it, they leave `_aborts`


def _error_type(exc: Exception) -> ErrorType:
    """A refused request is the sender's mistake (ValueError: 400), anything else ours (500)."""
    return ErrorType.INVALID if isinstance(exc, ValueError) else ErrorType.INTERNAL


class DecodeService:
    """Serves `decode.<id>.handoff` (hand-off streams from prefill), `decode.<id>.run` (the scheduler's announcements
    and prompts to compute here) and the broadcast `cancel`. A request joins the batch when its hand-off ended whole.

    Args:
        settings: service settings (KV deadline, heartbeat interval).
        bus: the NATS connection.
        engine: the decode engine.
    """

    def __init__(self, settings: EngineSettings, bus: Bus, engine: LLMEngine) -> None:
        self.settings, self.bus, self.engine = settings, bus, engine
        self.host: EngineHost[_Tick] = EngineHost(engine)
        self.receiver = HandoffReceiver(settings.kv_deadline_s, settings.kv_buffer_bytes, settings.request_timeout_s)
        self._kv_saved_bytes = 0  # what FastGen does not hold now, over the running requests (engine thread's)
        self._num_prompt_tokens_left = 0  # of prompts being prefilled here, still to compute (engine thread's)
        self._assembling: set[str] = set()  # hand-off ended, its KV being assembled off the event loop
        self._ready: deque[PrefilledRequest] = deque()  # KV assembled, not yet in the engine (EngineFull)
        self._running: set[str] = set()
        self.gaps = TokenGaps()  # of the running requests' tokens (event loop's)
        self._aborts: set[str] = set()  # cancelled while running: results of theirs still coming are dropped
        self._aborts_applied: set[str] = set()  # of those, the ones the engine has dropped (engine thread's)
        self._prompts: deque[tuple[PrefillTask, SamplingParams]] = deque()  # to prefill here
        self._samples: list[list[float]] = []  # decode step timings since the last heartbeat
        self._prefill_samples = StepSamples()  # steps that computed prompts and nothing else, since then
        self._moved_bytes = self._moved_tokens = 0  # prompt KV received on the wire since start, and its tokens
        self._lock = threading.Lock()  # _ready, _prompts, _running and _samples are shared with the engine thread
        self._heartbeat = HeartbeatSender(bus, settings.instance_id, Role.DECODE, settings.heartbeat_s, self.load)
        self._deadline_task: asyncio.Task[None] | None = None
        self.tasks = BackgroundTasks()  # assemblies of ended hand-offs

    async def start(self) -> None:
        if self.settings.warmup and self.settings.engine_kind == "real":  # the first heartbeat carries them
            for stats in await self.host.call(time_prefill_steps, self.engine):  # prompts are computed here too
                self._prefill_samples.add(stats)
            samples = await self.host.call(time_decode_steps, self.engine)
            with self._lock:
                self._samples += samples
        s, me = self.bus.subjects, self.settings.instance_id
        handoff: dict[type[Message], Handler] = {
            HandoffStart: self.on_handoff_start, KvChunk: self.on_handoff_part,
            FastGenProfilePart: self.on_handoff_part, HandoffEnd: self.on_handoff_end, Cancel: self.on_prefill_cancel,
        }
        await self.bus.route(s.decode_handoff(me), handoff)
        run: dict[type[Message], Handler] = {ExpectHandoff: self.on_expect_handoff, PrefillTask: self.on_prefill_task}
        await self.bus.route(s.decode_run(me), run)
        await self.bus.route(s.cancel, {Cancel: self.on_broadcast_cancel})
        self.host.start(self._tick, self._deliver)
        self._deadline_task = asyncio.create_task(self._enforce_deadlines())
        self._heartbeat.start()
        await self._heartbeat.send_now()

    async def stop(self) -> None:
        await self._heartbeat.stop()
        if self._deadline_task is not None:
            self._deadline_task.cancel()
        await self.tasks.close()
        await self.host.stop()

    @property
    def broken(self) -> asyncio.Event:
        """Set when the engine cannot recover (the process then exits to be restarted)."""
        return self.host.broken

    def load(self) -> Load:
        blocks = self.engine.block_manager
        with self._lock:
            running, ready = list(self._running), [r.request_id for r in self._ready]
            ready += [task.request_id for task, _ in self._prompts]
            samples, self._samples = self._samples, []
            local = sum(len(task.prompt_ids) for task, _ in self._prompts) + self._num_prompt_tokens_left
        return Load(
            num_running=len(running), num_waiting=len(self._assembling) + len(ready), num_queued_tokens=local,
            max_num_seqs=self.engine.runner.max_num_seqs,
            max_batched_tokens=self.engine.config.max_num_batched_tokens,
            kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks, kv_blocks_total=blocks.num_blocks,
            request_ids=[*running, *self._assembling, *ready, *self.receiver.request_ids()], samples=samples,
            prefill_samples=self._prefill_samples.take(),
            block_bytes=self.engine.store.block_footprint, kv_format=self.engine.config.kv_format,
            kv_block_tokens=self.engine.config.block_size, kv_moved_bytes=self._moved_bytes,
            kv_moved_tokens=self._moved_tokens, kv_saved_bytes=self._kv_saved_bytes,
        )

    async def on_handoff_start(self, msg: HandoffStart) -> None:
        error = self.receiver.start(msg)
        if error is not None:
            await self._fail(msg.request_id, str(error))

    async def on_handoff_part(self, msg: KvChunk | FastGenProfilePart) -> None:
        error = self.receiver.add(msg)
        if error is not None:
            await self._fail(msg.request_id, str(error))

    async def on_handoff_end(self, msg: HandoffEnd) -> None:
        """The stream is whole: the first token goes out at once (this instance writes the response stream from
        here on), then the prompt's KV is assembled off the event loop and queued for the engine."""
        stream, error = self.receiver.end(msg)
        if error is not None:
            await self._fail(msg.request_id, str(error))
        if stream is None:
            return
        request_id = msg.request_id
        first = StreamEvent(request_id, 0, [msg.first_token], msg.first_text, None, len(stream.start.prompt_ids),
                            msg.num_cached_tokens)
        await self.bus.publish(self.bus.subjects.stream(request_id), first)
        self.gaps.made(request_id)  # token 0 counts from here: its gap to token 1 holds the KV assembly and the join
        self._assembling.add(request_id)
        self.tasks.spawn(self._admit_handoff(stream), f"assemble-{request_id}")

    async def _admit_handoff(self, stream: HandoffStream) -> None:
        """Assemble the request on a worker thread (other streams keep arriving meanwhile) and queue it for the
        engine, unless it was cancelled meanwhile (its client heard already)."""
        request_id = stream.request_id
        try:
            request, error = await asyncio.to_thread(self._prefilled, stream), ""
        except (PartError, ValueError) as exc:
            request, error = None, str(exc)
        if request_id not in self._assembling:  # cancelled meanwhile
            return
        self._assembling.discard(request_id)
        if request is None:
            await self._fail(request_id, error)
            return
        self._moved_bytes += stream.kv.num_wire_bytes
        self._moved_tokens += len(stream.start.prompt_ids)
        with self._lock:
            self._ready.append(request)
        self.host.wake()

    def _prefilled(self, stream: HandoffStream) -> PrefilledRequest:
        """A worker thread: the request as the engine takes it, from its whole stream.

        Raises:
            PartError: KV that does not make this engine's prompt. ProfileError: a profile of another shape.
        """
        start, end, cfg = stream.start, stream.end, self.engine.model_config
        assert end is not None
        profile = None if stream.profile is None else profile_of(
            stream.profile, cfg.num_layers, cfg.num_kv_heads, len(start.prompt_ids), self.engine.config.fastgen.full + 1
        )
        kv = PromptKv(*assemble_prompt(stream.kv, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                       self.engine.block_format))
        return PrefilledRequest(start.request_id, start.prompt_ids, end.first_token, len(end.first_text),
                                start.sampling, kv, end.num_cached_tokens, profile)

    async def on_expect_handoff(self, msg: ExpectHandoff) -> None:
        self.receiver.expect(msg.request_id)

    async def on_prefill_cancel(self, msg: Cancel) -> None:
        """A hand-off stream closed early (the request finished or failed at prefill): prefill told the client."""
        self._cancel(msg)

    async def on_broadcast_cancel(self, msg: Cancel) -> None:
        """Drop the request wherever it is here, and say so on its stream: whoever cancelled it, its client hears
        (a gateway that cancelled has stopped listening)."""
        if self._cancel(msg):
            await self._fail(msg.request_id, f"the request was cancelled: {msg.reason}", ErrorType.UNAVAILABLE)

    async def on_prefill_task(self, task: PrefillTask) -> None:
        """Conditional disaggregation: the scheduler judged this prompt cheaper to compute here than to move."""
        try:
            params = task.sampling
        except ValueError as exc:
            await self._fail(task.request_id, str(exc), ErrorType.INVALID)
            return
        with self._lock:
            self._prompts.append((task, params))
        log.info("prefill on decode", request_id=task.request_id, prompt_tokens=len(task.prompt_ids))
        self.host.wake()

    def _cancel(self, msg: Cancel) -> bool:
        """Drop the request wherever it is here; True when this instance held it."""
        request_id = msg.request_id
        held = request_id in self.receiver or request_id in self._assembling or self.receiver.is_expected(request_id)
        self.receiver.close(request_id)
        self._assembling.discard(request_id)
        self.gaps.forget(request_id)
        with self._lock:
            ready = [r for r in self._ready if r.request_id == request_id]
            prompts = [p for p in self._prompts if p[0].request_id == request_id]
            for entry in ready:
                self._ready.remove(entry)
            for prompt in prompts:
                self._prompts.remove(prompt)
            is_running = request_id in self._running
        held = held or is_running or bool(ready or prompts)
        if is_running:
            self._aborts.add(request_id)
            self.host.wake()
        if held:
            log.info("decode cancelled", request_id=request_id, reason=msg.reason)
        return held

    async def _enforce_deadlines(self) -> None:
        """Fail requests whose hand-off stalled."""
        deadline = self.settings.kv_deadline_s
        while True:
            await asyncio.sleep(min(0.5, deadline / 4))
            for request_id, reason in self.receiver.expire():
                await self._fail(request_id, reason)

    # ---- the engine thread ------------------------------------------------------------------------------------

    def _tick(self) -> tuple[list[_Tick], bool]:
        aborted = tuple(r for r in list(self._aborts) if r not in self._aborts_applied)
        for request_id in aborted:
            self._aborts_applied.add(request_id)
            self.engine.abort(request_id)
            with self._lock:
                self._running.discard(request_id)
        failures = self._admit_prompts() + self._admit_ready()
        outputs = self._timed_step() if self.engine.has_unfinished() else []
        scheduler = self.engine.scheduler
        prompts_left = sum(s.num_uncomputed_tokens for s in [*scheduler.running, *scheduler.waiting]
                           if s.num_uncomputed_tokens > 1)
        with self._lock:  # a finished request stays in `_running` until its last event is out (`_deliver`)
            self._kv_saved_bytes = self.engine.kv_bytes_saved()
            self._num_prompt_tokens_left = prompts_left
        results: list[RequestOutput | _Failure] = [*failures, *outputs]
        tick = _Tick(results, self.engine.runner.tokens_ready_at, aborted)
        return ([tick] if results or aborted else []), self.engine.has_unfinished()

    def _timed_step(self) -> list[RequestOutput]:
        """One engine step; a pure decode step's time becomes a sample for the scheduler's TBT model, a step of
        prompts alone one for its prefill model."""
        running = self.engine.scheduler.running
        is_pure_decode = not self.engine.scheduler.waiting and all(s.num_uncomputed_tokens == 1 for s in running)
        is_prompts_only = all(s.num_uncomputed_tokens > 1 for s in [*running, *self.engine.scheduler.waiting])
        batch, context = len(running), sum(s.num_tokens for s in running)
        started = time.perf_counter()
        last_step = self.engine.last_step
        outputs = self.engine.step()
        if is_pure_decode and batch:
            with self._lock:
                self._samples.append([float(batch), float(context), time.perf_counter() - started])
        elif is_prompts_only and self.engine.last_step is not last_step and self.engine.last_step is not None:
            self._prefill_samples.add(self.engine.last_step)
        return outputs

    def _admit_prompts(self) -> list[_Failure]:
        """Queue prompts sent here for local prefill into the engine (its scheduler batches them with decodes)."""
        with self._lock:
            prompts, self._prompts = list(self._prompts), deque()
        failures = []
        for task, params in prompts:
            try:
                self.engine.add_request(task.request_id, task.prompt_ids, params)
            except Exception as exc:  # a bad prompt (ValueError) or worse: this request's alone
                failures.append(_Failure(task.request_id, str(exc), _error_type(exc)))
                continue
            with self._lock:
                self._running.add(task.request_id)
        return failures

    def _admit_ready(self) -> list[_Failure]:
        """Move assembled requests into the engine while it has room (the rest wait for finished ones); those it
        refuses fail, alone."""
        failures: list[_Failure] = []
        while True:
            with self._lock:
                if not self._ready:
                    return failures
                request = self._ready[0]
            failure = None
            try:
                self.engine.add_prefilled(request)
            except EngineFull:
                return failures
            except Exception as exc:  # KV or a prompt that does not fit (ValueError), or worse: this request's alone
                failure = _Failure(request.request_id, f"decode refused the request: {exc}", _error_type(exc))
                failures.append(failure)
            with self._lock:
                self._ready.popleft()
                if failure is None:
                    self._running.add(request.request_id)

    # ---- back on the event loop -------------------------------------------------------------------------------

    async def _deliver(self, ticks: list[_Tick]) -> None:
        for tick in ticks:
            try:
                await self._deliver_tick(tick)
            finally:  # even when publishing failed: these requests are gone from the engine
                for request_id in tick.aborted:
                    self._aborts.discard(request_id)
                    self._aborts_applied.discard(request_id)

    async def _deliver_tick(self, tick: _Tick) -> None:
        """Each step's outputs, in order; a finished request leaves `_running` here, not when the step ended on the
        engine thread: until its last event is out, its instance still holds it (so a heartbeat between the two
        never shows it held by nobody)."""
        outputs = tick.results
        with self._lock:
            self._running.difference_update(out.request_id for out in outputs
                                            if isinstance(out, RequestOutput) and out.finished)
        for out in outputs:
            if out.request_id in self._aborts:  # cancelled while this step ran: its client heard already
                continue
            if isinstance(out, _Failure):
                await self._fail(out.request_id, out.error, out.error_type)
                continue
            if out.finish_reason == FinishReason.ERROR:
                await self._fail(out.request_id, f"the engine failed on this request: {out.error}",
                                 ErrorType.INTERNAL)
                continue
            event = StreamEvent(
                out.request_id, out.num_output_tokens - len(out.new_token_ids), out.new_token_ids, out.new_text,
                out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens, kv_bytes_saved=out.kv_bytes_saved,
            )
            await self.bus.publish(self.bus.subjects.stream(out.request_id), event)
            if out.new_token_ids:
                self.gaps.made(out.request_id, tick.tokens_ready_at)
            if out.finished:
                tbt_s = self.gaps.finish(out.request_id)
                log.info("decoded", request_id=out.request_id, reason=out.finish_reason,
                         output_tokens=out.num_output_tokens, tbt_ms=None if tbt_s is None else round(tbt_s * 1e3, 3))

    async def _fail(self, request_id: str, error: str, error_type: ErrorType = ErrorType.KV_TRANSFER) -> None:
        log.warning("request failed", request_id=request_id, error_type=error_type, error=error)
        self.gaps.forget(request_id)
        event = StreamEvent.failure(request_id, error_type, error)
        await self.bus.publish(self.bus.subjects.stream(request_id), event)
