"""The decode service: receives prompt KV in verified chunks, joins each request to its continuous batch once its KV
is complete, and streams tokens to the gateway. A stalled or corrupt KV stream fails only its own request.

It never computes prompts (that is services.prefill) and trusts no KV that did not pass its checksum.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass

from services.common.engine_host import EngineHost
from services.common.warmup import time_decode_steps
from shared.config import EngineSettings
from shared.engine.engine import EngineFull, LLMEngine, PrefilledRequest, RequestOutput
from shared.engine.kv.store import PromptKv
from shared.engine.sequence import FinishReason
from shared.fastgen.wire import ProfileError, ProfileParts
from shared.wire.bus import Bus
from shared.wire.heartbeat import HeartbeatSender, Load
from shared.wire.kv_transfer.chunks import KvTransferError
from shared.wire.kv_transfer.prompt import assemble_prompt
from shared.wire.kv_transfer.receiver import KvReceiver
from shared.wire.log import get_logger
from shared.wire.protocol import (
    Cancel,
    DecodeTask,
    ErrorType,
    ExpectHandoff,
    FastGenProfilePart,
    KvChunk,
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


def _error_type(exc: Exception) -> ErrorType:
    """A refused request is the sender's mistake (ValueError: 400), anything else ours (500)."""
    return ErrorType.INVALID if isinstance(exc, ValueError) else ErrorType.INTERNAL


@dataclass
class _Waiting:
    """A request whose DecodeTask arrived; its KV may still be in flight."""

    task: DecodeTask
    since: float  # monotonic seconds


class DecodeService:
    """Serves `decode.<id>.kv`, `decode.<id>.run` and the broadcast `cancel`. A DecodeTask may arrive before or after
    the last chunk of its KV; the request joins the batch when both are in.

    Args:
        settings: service settings (KV deadline, heartbeat interval).
        bus: the NATS connection.
        engine: the decode engine.
    """

    def __init__(self, settings: EngineSettings, bus: Bus, engine: LLMEngine) -> None:
        self.settings, self.bus, self.engine = settings, bus, engine
        self.host: EngineHost[RequestOutput | _Failure] = EngineHost(engine)
        self.receiver = KvReceiver(settings.kv_deadline_s, settings.kv_buffer_bytes, settings.request_timeout_s)
        self.profiles = ProfileParts()  # FastGen profiles that follow some prompts' KV
        self._kv_saved_bytes = 0  # what FastGen does not hold now, over the running requests (engine thread's)
        self._num_prompt_tokens_left = 0  # of prompts being prefilled here, still to compute (engine thread's)
        self._waiting: dict[str, _Waiting] = {}  # DecodeTask in, KV not complete yet
        self._ready: deque[PrefilledRequest] = deque()  # KV assembled, not yet in the engine (EngineFull)
        self._running: set[str] = set()
        self._aborts: set[str] = set()
        self._prompts: deque[tuple[PrefillTask, SamplingParams]] = deque()  # to prefill here
        self._samples: list[list[float]] = []  # decode step timings since the last heartbeat
        self._moved_bytes = self._moved_tokens = 0  # prompt KV received on the wire since start, and its tokens
        self._lock = threading.Lock()  # _ready, _prompts, _running and _samples are shared with the engine thread
        self._heartbeat = HeartbeatSender(bus, settings.instance_id, Role.DECODE, settings.heartbeat_s, self.load)
        self._deadline_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.settings.warmup and self.settings.engine_kind == "real":  # the first heartbeat carries them
            samples = await self.host.call(time_decode_steps, self.engine)
            with self._lock:
                self._samples += samples
        s, me = self.bus.subjects, self.settings.instance_id
        await self.bus.route(s.decode_kv(me), {KvChunk: self.on_chunk, FastGenProfilePart: self.on_profile_part})
        await self.bus.route(s.decode_run(me), {
            ExpectHandoff: self.on_expect_handoff, DecodeTask: self.on_decode_task, PrefillTask: self.on_prefill_task,
            Cancel: self.on_prefill_cancel,
        })
        await self.bus.route(s.cancel, {Cancel: self.on_broadcast_cancel})
        self.host.start(self._tick, self._deliver)
        self._deadline_task = asyncio.create_task(self._enforce_deadlines())
        self._heartbeat.start()
        await self._heartbeat.send_now()

    async def stop(self) -> None:
        await self._heartbeat.stop()
        if self._deadline_task is not None:
            self._deadline_task.cancel()
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
            num_running=len(running), num_waiting=len(self._waiting) + len(ready), num_queued_tokens=local,
            max_num_seqs=self.engine.runner.max_num_seqs,
            kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks, kv_blocks_total=blocks.num_blocks,
            request_ids=[*running, *self._waiting, *ready, *self.receiver.request_ids()], samples=samples,
            block_bytes=self.engine.store.block_footprint, kv_format=self.engine.config.kv_format,
            kv_block_tokens=self.engine.config.block_size, kv_moved_bytes=self._moved_bytes,
            kv_moved_tokens=self._moved_tokens, kv_saved_bytes=self._kv_saved_bytes,
        )

    async def on_chunk(self, msg: KvChunk) -> None:
        error = self.receiver.add(msg)
        if error is not None:
            self._waiting.pop(msg.request_id, None)
            self.profiles.discard(msg.request_id)
            await self._fail(msg.request_id, str(error))
            return
        await self._maybe_ready(msg.request_id)

    async def on_profile_part(self, msg: FastGenProfilePart) -> None:
        if msg.request_id not in self.receiver:  # no KV stream (failed, cancelled or never opened): nothing to join
            return
        try:
            self.profiles.add(msg)
        except ProfileError as exc:
            self._waiting.pop(msg.request_id, None)
            self.receiver.discard(msg.request_id)
            self.profiles.discard(msg.request_id)
            await self._fail(msg.request_id, str(exc))
            return
        await self._maybe_ready(msg.request_id)

    async def on_expect_handoff(self, msg: ExpectHandoff) -> None:
        self.receiver.expect(msg.request_id)

    async def on_prefill_cancel(self, msg: Cancel) -> None:
        """From the prefill instance (the request finished or failed there): it told the client already."""
        self._cancel(msg)

    async def on_broadcast_cancel(self, msg: Cancel) -> None:
        """Drop the request wherever it is here, and say so on its stream: whoever cancelled it, its client hears
        (a gateway that cancelled has stopped listening)."""
        if self._cancel(msg):
            await self._fail(msg.request_id, f"the request was cancelled: {msg.reason}", ErrorType.UNAVAILABLE)

    async def on_decode_task(self, task: DecodeTask) -> None:
        request_id = task.request_id
        if self.receiver.is_closed(request_id):  # its KV stream failed (already reported) or was cancelled
            log.info("decode task after its KV stream closed: dropped", request_id=request_id)
            return
        if request_id not in self.receiver and not self.receiver.is_expected(request_id):
            await self._fail(request_id, "decode has no KV for this request and was not told to expect it")
            return
        self._waiting[request_id] = _Waiting(task, time.monotonic())
        await self._maybe_ready(request_id)

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
        held = request_id in self.receiver or request_id in self._waiting or self.receiver.is_expected(request_id)
        self.receiver.discard(request_id)
        self.profiles.discard(request_id)
        self._waiting.pop(request_id, None)
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

    async def _maybe_ready(self, request_id: str) -> None:
        waiting = self._waiting.get(request_id)
        if waiting is None or not self.receiver.is_complete(request_id):
            return
        if self.profiles.num_received(request_id) < waiting.task.num_profile_parts:
            return  # its FastGen profile follows the KV (a stall expires with the KV stream)
        assembly = self.receiver.take_complete(request_id)
        del self._waiting[request_id]
        task, cfg = waiting.task, self.engine.model_config
        try:
            if assembly is None or assembly.num_received != task.num_chunks:
                raise KvTransferError(f"request {request_id}: expected {task.num_chunks} KV chunks")
            profile = None if not task.num_profile_parts else self.profiles.take(
                request_id, cfg.num_layers, cfg.num_kv_heads, len(task.prompt_ids), self.engine.config.fastgen.full + 1)
            kv = PromptKv(*await asyncio.to_thread(
                assemble_prompt, assembly, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.engine.block_format
            ))
            params = _continuation_params(task.sampling)
        except (KvTransferError, ValueError) as exc:
            await self._fail(request_id, str(exc))
            return
        self._moved_bytes += assembly.num_wire_bytes
        self._moved_tokens += len(task.prompt_ids)
        request = PrefilledRequest(
            request_id, task.prompt_ids, task.first_token, task.num_emitted_chars, params, kv, task.num_cached_tokens,
            profile,
        )
        with self._lock:
            self._ready.append(request)
        self.host.wake()

    async def _enforce_deadlines(self) -> None:
        """Fail requests whose KV stream stalled, or whose KV never started arriving."""
        deadline = self.settings.kv_deadline_s
        while True:
            await asyncio.sleep(min(0.5, deadline / 4))
            for request_id, reason in self.receiver.expire():
                self._waiting.pop(request_id, None)
                self.profiles.discard(request_id)
                await self._fail(request_id, reason)
            now = time.monotonic()
            for request_id, waiting in list(self._waiting.items()):
                if request_id not in self.receiver and now - waiting.since > deadline:
                    del self._waiting[request_id]
                    await self._fail(request_id, f"no KV chunk arrived within {deadline} s")

    # ---- the engine thread ------------------------------------------------------------------------------------

    def _tick(self) -> tuple[list[RequestOutput | _Failure], bool]:
        for request_id in list(self._aborts):
            self._aborts.discard(request_id)
            self.engine.abort(request_id)
            with self._lock:
                self._running.discard(request_id)
        failures = self._admit_prompts() + self._admit_ready()
        outputs = self._timed_step() if self.engine.has_unfinished() else []
        scheduler = self.engine.scheduler
        prompts_left = sum(s.num_uncomputed_tokens for s in [*scheduler.running, *scheduler.waiting]
                           if s.num_uncomputed_tokens > 1)
        with self._lock:
            self._running.difference_update(out.request_id for out in outputs if out.finished)
            self._kv_saved_bytes = self.engine.kv_bytes_saved()
            self._num_prompt_tokens_left = prompts_left
        return [*failures, *outputs], self.engine.has_unfinished()

    def _timed_step(self) -> list[RequestOutput]:
        """One engine step; a pure decode step's time becomes a sample for the scheduler's TBT model."""
        running = self.engine.scheduler.running
        is_pure_decode = not self.engine.scheduler.waiting and all(s.num_uncomputed_tokens == 1 for s in running)
        batch, context = len(running), sum(s.num_tokens for s in running)
        started = time.perf_counter()
        outputs = self.engine.step()
        if is_pure_decode and batch:
            with self._lock:
                self._samples.append([float(batch), float(context), time.perf_counter() - started])
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

    async def _deliver(self, outputs: list[RequestOutput | _Failure]) -> None:
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
            if out.finished:
                log.info("decoded", request_id=out.request_id, reason=out.finish_reason,
                         output_tokens=out.num_output_tokens)

    async def _fail(self, request_id: str, error: str, error_type: ErrorType = ErrorType.KV_TRANSFER) -> None:
        log.warning("request failed", request_id=request_id, error_type=error_type, error=error)
        event = StreamEvent.failure(request_id, error_type, error)
        await self.bus.publish(self.bus.subjects.stream(request_id), event)


def _continuation_params(params: SamplingParams) -> SamplingParams:
    """Prefill drew the first token from a generator seeded with `seed`; a fresh generator with the same seed here
    would repeat that draw for the second token, so the continuation gets its own stream, derived from the seed."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed * 0x9E3779B1 + 1) % (1 << 63))
