"""The prefill service: computes prompts, loading the reusable prefix from the cache-store layer by layer while it
computes; hands each request to the chosen decode instance in one ordered stream (a header, each layer's KV as it is
computed, FastGen's profile, an end with the first token); stores new full blocks in the cache-store, and reports its
local cache (KV events, snapshots) and step timings (heartbeats). It writes a request's response stream only when the
request ends here (finished at its first token, or failed before its hand-off ended); decode writes the rest.

It owns a prompt-only engine (every request leaves it after its first token); decoding belongs to services.decode.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from services.common.engine_host import EngineHost
from services.common.step_samples import StepSamples
from services.common.tasks import BackgroundTasks
from services.common.warmup import time_prefill_steps
from services.prefill.fetch import StoreLoader
from services.prefill.kv_send import LayerSender
from services.prefill.stage import PipelineStage
from shared.config import EngineSettings
from shared.engine.engine import LLMEngine, RequestOutput, StepStats
from shared.engine.kv.prefix_load import PrefixSource
from shared.engine.sequence import FinishReason, Sequence
from shared.wire.block_hash import block_hashes
from shared.wire.bus import Bus
from shared.wire.cache_client import CacheClient
from shared.wire.handoff.profile import PromptProfile, profile_parts
from shared.wire.handoff.prompt import num_prompt_chunks
from shared.wire.heartbeat import HeartbeatSender, Load
from shared.wire.kv_events import KvEventLog, KvEventPublisher
from shared.wire.log import get_logger
from shared.wire.payload import Payload
from shared.wire.protocol import (
    Cancel,
    ErrorType,
    HandoffEnd,
    HandoffStart,
    Message,
    PrefillTask,
    Role,
    SamplingParams,
    Snapshot,
    SnapshotRequest,
    StreamEvent,
    attention_work,
)

log = get_logger(__name__)


@dataclass
class _Held:
    """A request from arrival until its hand-off to decode."""

    task: PrefillTask
    hashes: list[int]
    num_store_blocks: int = 0  # leading blocks the cache-store already holds
    num_reused_tokens: int = 0  # expected from the local cache or the cache-store
    num_chunks: int = 0
    sends: list[asyncio.Future[None]] = field(default_factory=list)
    sent_layers: set[int] = field(default_factory=set)  # a request recomputed after a failed load sends each once
    is_handing_off: bool = False  # its hand-off stream to decode is open (a failure must close it)
    cancelled: bool = False
    is_prefilled: bool = False
    profile: PromptProfile | None = None  # FastGen's, when the engine runs it: decode keeps what it says


class PrefillService:
    """Serves `prefill.<id>.run`, the broadcast `cancel` and `snapshot.<id>`; publishes `kv.events.<id>`.

    Args:
        settings: service settings.
        bus: the NATS connection.
        engine: a prompt-only engine (this service aborts each request after its first token), built with
            `events.record` as its block-event hook (`services.prefill.__main__.build` makes both).
        cache: the cache-store client, or None to run without the shared pool.
        events: the log of the engine's prefix-cache changes, in this instance's epoch.
        stage: its stage of a pipeline group: long prompts that reach the group's first stage run on the group.
    """

    def __init__(
        self, settings: EngineSettings, bus: Bus, engine: LLMEngine, cache: CacheClient | None, events: KvEventLog,
        stage: PipelineStage | None = None,
    ) -> None:
        self.settings, self.bus, self.engine, self.cache = settings, bus, engine, cache
        self.stage = stage  # this instance's stage of its pipeline group (`TSUKIMI_CPP_GROUP`), if it is in one
        self.host: EngineHost[tuple[RequestOutput, list[Payload] | None]] = EngineHost(engine)
        if stage is not None:  # its engine thread breaking breaks the instance too: it is restarted whole
            stage.host.broken = self.host.broken
            stage.after_step = self._announce_events  # its prefix cache reports into this instance's KV events
        self._held: dict[str, _Held] = {}
        self._aborts: set[str] = set()
        self._heartbeat = HeartbeatSender(
            bus, settings.instance_id, Role.PREFILL, settings.heartbeat_s, self.load, events.epoch
        )
        self.events = events
        events_subject = bus.subjects.kv_events(Role.PREFILL, settings.instance_id)
        self._events_out = KvEventPublisher(bus, self.events, events_subject)
        self.tasks = BackgroundTasks()  # KV sends, cache puts, event publishes
        self.samples = StepSamples()
        self._last_stats: StepStats | None = None
        self.loader = None if cache is None else StoreLoader(
            cache, engine.store, self.host.loop, settings.kv_deadline_s
        )
        self.sender = LayerSender(settings, bus, self.host, self.tasks)
        self._moved_tokens = 0  # prompt tokens whose KV went to decode since start

    async def start(self) -> None:
        if self.settings.warmup and self.settings.engine_kind == "real":  # the first heartbeat carries them
            for stats in await self.host.call(time_prefill_steps, self.engine):
                self.samples.add(stats)
        subjects, me = self.bus.subjects, self.settings.instance_id
        await self.bus.route(subjects.prefill_run(me), {PrefillTask: self.handle_task})
        await self.bus.route(subjects.cancel, {Cancel: self.handle_cancel})
        await self.bus.route(subjects.snapshot(Role.PREFILL, me), {SnapshotRequest: self.handle_snapshot})
        self.host.start(self._tick, self._deliver)
        if self.stage is not None:
            await self.stage.start()
        self._heartbeat.start()
        await self._heartbeat.send_now()

    @property
    def broken(self) -> asyncio.Event:
        """Set when the engine (or the pipeline stage's) cannot recover (the process then exits to be restarted)."""
        return self.host.broken

    async def stop(self) -> None:
        await self._heartbeat.stop()
        if self.loader is not None:
            await self.loader.stop()
        await self.host.stop()
        if self.stage is not None:
            await self.stage.stop()
        await self.tasks.close()
        self.sender.close()

    def load(self) -> Load:
        """This beat's figures: the prompt tokens still to compute and their attention work (a prompt part-computed
        counts what is left of it, so the scheduler's view shrinks step by step, not a whole prompt at a time), and
        the step samples since the last beat."""
        queued = [h for h in self._held.values() if not h.is_prefilled]
        blocks = self.engine.block_manager
        left = [(len(h.task.prompt_ids), max(h.num_reused_tokens, self.engine.num_computed_tokens(h.task.request_id)))
                for h in queued]
        stage = self.stage
        return Load(
            num_waiting=len(queued),
            num_queued_tokens=sum(num_tokens - done for num_tokens, done in left),
            queued_attention_work=float(sum(attention_work(num_tokens, done) for num_tokens, done in left)),
            kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks, kv_blocks_total=blocks.num_blocks,
            request_ids=list(self._held) + (stage.request_ids if stage else []),
            samples=self.samples.take() + (stage.samples.take() if stage else []),
            fetch_bytes_per_s=0.0 if self.loader is None else self.loader.bandwidth.value,
            block_bytes=self.engine.store.block_footprint, kv_format=self.engine.config.kv_format,
            kv_block_tokens=self.engine.config.block_size,
            kv_moved_bytes=self.sender.num_bytes + (stage.sender.num_bytes if stage else 0),
            kv_moved_tokens=self._moved_tokens + (stage.num_moved_tokens if stage else 0),
            max_num_seqs=self.engine.runner.max_num_seqs,
            max_batched_tokens=self.engine.config.max_num_batched_tokens,
            pipeline_group=list(self.settings.cpp_group) if stage else [],
            pipeline_min_tokens=self.settings.cpp_min_tokens if stage else 0,
            pipeline_row_bytes=stage.row_bytes if stage else 0,
            pipeline_namespace=stage.namespace if stage else "",
        )

    async def handle_task(self, msg: PrefillTask) -> None:
        try:
            params = msg.sampling
            self.engine.check_prompt(msg.prompt_ids)  # before any work: its ids hash, load and compute
        except ValueError as exc:
            await self._fail(msg.request_id, ErrorType.INVALID, str(exc))
            return
        size = self.engine.config.block_size
        hashes = block_hashes(msg.prompt_ids, size, self.engine.block_manager.namespace)
        if msg.block_hashes and msg.block_hashes != hashes:
            log.warning("block hashes differ from the gateway's (model or codec mismatch?)", request_id=msg.request_id)
        held = _Held(msg, hashes, num_chunks=self._num_chunks(len(msg.prompt_ids)))
        self._held[msg.request_id] = held
        log.info("prefill queued", request_id=msg.request_id, prompt_tokens=len(msg.prompt_ids), decode=msg.decode_id,
                 fetch_from_pool=msg.fetch_from_pool)
        self.tasks.spawn(self._admit(held, params), f"admit-{msg.request_id}")

    async def handle_cancel(self, msg: Cancel) -> None:
        if self.stage is not None:
            await self.stage.handle_cancel(msg)
        held = self._held.get(msg.request_id)
        if held is not None:
            held.cancelled = True
            self._aborts.add(msg.request_id)
            self.host.wake()
            log.info("prefill cancelled", request_id=msg.request_id, reason=msg.reason)
            # whoever cancelled it, its client hears (a gateway that cancelled has stopped listening)
            await self._fail_held(held, ErrorType.UNAVAILABLE, f"the request was cancelled: {msg.reason}")

    async def handle_snapshot(self, msg: SnapshotRequest) -> Snapshot:
        """Every hash in the local prefix cache, as of the last KV event (those numbered on the way go out first)."""
        return await self._events_out.snapshot()

    def _num_chunks(self, num_tokens: int) -> int:
        return num_prompt_chunks(self.engine.model_config.num_layers, num_tokens, self.engine.block_format,
                                 self.sender.part_bytes)

    async def _admit(self, held: _Held, params: SamplingParams) -> None:
        """See what the cache-store holds, then queue the prompt in the engine (with the store's prefix to load)."""
        task = held.task
        if self.stage is not None and await self.stage.takes(task.prompt_ids):
            await self._lead_pipeline(held)
            return
        try:
            source = await self._store_prefix(held)
            if not held.cancelled:  # the stream opens before any of its KV can be sent
                await self._publish_handoff(held, HandoffStart(
                    task.request_id, task.prompt_ids, task.sampling, self.settings.instance_id, held.num_chunks
                ))
                held.is_handing_off = True
            is_queued = not held.cancelled and await self.host.call(self._enqueue, held, params, source)
        except Exception as exc:
            is_queued = False
            await self._fail_held(held, ErrorType.INVALID if isinstance(exc, ValueError) else ErrorType.INTERNAL,
                                  str(exc))
        if not is_queued:  # cancelled meanwhile (a failure closed its hand-off already)
            await self._close_handoff(held, "cancelled at prefill")
            self._held.pop(task.request_id, None)
            return
        self.host.wake()

    async def _lead_pipeline(self, held: _Held) -> None:
        """A long prompt runs on the pipeline group this instance leads: open its hand-off, then the stage has it
        (the stages load their layers of a prefix from their caches and the cache-store themselves)."""
        task = held.task
        self._held.pop(task.request_id, None)
        if held.cancelled:
            return
        await self._publish_handoff(held, HandoffStart(
            task.request_id, task.prompt_ids, task.sampling, self.settings.instance_id, held.num_chunks
        ))
        assert self.stage is not None
        await self.stage.lead(task, held.num_chunks)

    async def _store_prefix(self, held: _Held) -> PrefixSource | None:
        """How much of the prompt the cache-store holds; a source of it when the task lets us fetch it."""
        if self.cache is None or self.loader is None or not held.hashes:
            return None
        held.num_store_blocks = await self.cache.longest_prefix(held.hashes)
        size = self.engine.config.block_size
        # The last block of a block-aligned prompt is always computed (its last token must be sampled from).
        num_blocks = min(held.num_store_blocks, (len(held.task.prompt_ids) - 1) // size)
        if not held.task.fetch_from_pool or num_blocks == 0:
            return None
        held.num_reused_tokens = num_blocks * size
        return self.loader.source(held.task.request_id, held.hashes[:num_blocks], size)

    def _enqueue(self, held: _Held, params: SamplingParams, source: PrefixSource | None) -> bool:
        """Engine thread: queue the request unless it was cancelled meanwhile."""
        if held.cancelled:
            return False
        local = self.engine.block_manager.num_reusable_tokens(held.task.prompt_ids)
        held.num_reused_tokens = max(held.num_reused_tokens, local)
        self.engine.add_request(held.task.request_id, held.task.prompt_ids, params, source)
        return True

    # ---- the engine thread ------------------------------------------------------------------------------------

    def _tick(self) -> tuple[list[tuple[RequestOutput, list[Payload] | None]], bool]:
        """One engine step on the engine thread; each finished prompt leaves the engine with its new blocks."""
        for request_id in list(self._aborts):
            self._aborts.discard(request_id)
            self.engine.abort(request_id)
        results = []
        if self.engine.has_unfinished():
            for out in self.engine.step(self._on_layer):
                results.append((out, self._leave(out)))
            stats = self.engine.last_step
            if stats is not None and stats is not self._last_stats:
                self._last_stats = stats
                self.samples.add(stats)
        self._announce_events()
        return results, self.engine.has_unfinished()

    def _announce_events(self) -> None:
        """Any thread, after a step of the engine or of the pipeline stage (both record into `events`): publish
        what their prefix caches changed."""
        if self.events.has_pending:
            self.host.loop.call_soon_threadsafe(self._flush_events)

    def _leave(self, out: RequestOutput) -> list[Payload] | None:
        """A prompt is done: take it out of the engine; returns its new full blocks for the cache-store."""
        held = self._held.get(out.request_id)
        new_blocks = None
        if held is not None:
            held.is_prefilled = True
            held.profile = self.engine.take_profile(out.request_id)
            num_full = len(held.task.prompt_ids) // self.engine.config.block_size
            first = held.num_store_blocks
            if self.cache is not None and out.finish_reason != FinishReason.ERROR and num_full > first:
                if out.finished:  # ended at its first token: the engine left its blocks in its prefix cache
                    new_blocks = self.engine.export_cached_payloads(held.hashes[first:num_full], first)
                else:
                    new_blocks = self.engine.export_block_payloads(out.request_id, first, num_full - first)
        self.engine.abort(out.request_id)
        return new_blocks

    def _on_layer(self, layer_idx: int, seqs: list[Sequence]) -> None:
        """Engine thread, mid-forward: copy this layer's prompt KV and hand it to the event loop to send."""
        for seq in seqs:
            held = self._held.get(seq.request_id)
            if held is None or held.cancelled or layer_idx in held.sent_layers:
                continue
            held.sent_layers.add(layer_idx)
            kv = self.engine.read_prompt_kv(seq.request_id, layer_idx)
            held.sends.append(self.sender.send(held.task, layer_idx, kv, self.engine.block_format, held.num_chunks,
                                               self.engine.model_config.num_layers))

    # ---- back on the event loop -------------------------------------------------------------------------------

    async def _deliver(self, results: list[tuple[RequestOutput, list[Payload] | None]]) -> None:
        for out, new_blocks in results:
            held = self._held.pop(out.request_id, None)
            if held is None or held.cancelled:
                continue
            if out.finish_reason == FinishReason.ERROR:
                await self._fail_held(held, ErrorType.INTERNAL, f"the engine failed on this request: {out.error}")
                continue
            try:
                await asyncio.gather(*held.sends)
            except Exception as exc:
                await self._fail_held(held, ErrorType.KV_TRANSFER, f"sending KV failed: {exc}")
                continue
            await self._hand_off(held, out)
            if new_blocks is not None:
                self.tasks.spawn(self._store_blocks(held, new_blocks), f"store-blocks-{out.request_id}")

    async def _hand_off(self, held: _Held, out: RequestOutput) -> None:
        """End the request's hand-off with its first token (decode streams it to the client), or, when the request
        finished at that token, write its whole response here and close the hand-off."""
        task = held.task
        if out.finished:
            await self.bus.publish(self.bus.subjects.stream(task.request_id), StreamEvent(
                task.request_id, 0, out.new_token_ids, out.new_text, out.finish_reason, out.num_prompt_tokens,
                out.num_cached_tokens,
            ))
            await self._close_handoff(held, "finished at prefill")
            log.info("finished at prefill", request_id=task.request_id, reason=out.finish_reason)
            return
        self._moved_tokens += len(task.prompt_ids)
        parts = [] if held.profile is None else profile_parts(task.request_id, held.profile, self.sender.part_bytes)
        for part in parts:
            await self._publish_handoff(held, part)
        await self._publish_handoff(held, HandoffEnd(
            task.request_id, out.new_token_ids[0], out.new_text, out.num_cached_tokens, len(parts)
        ))
        held.is_handing_off = False
        log.info("prefilled", request_id=task.request_id, cached_tokens=out.num_cached_tokens,
                 ttft_s=round(time.time() - task.arrival_time, 4), kv_chunks=held.num_chunks)

    async def _publish_handoff(self, held: _Held, msg: Message) -> None:
        """One message of the request's hand-off stream (all on one subject, so decode gets them in order)."""
        await self.bus.publish(self.bus.subjects.decode_handoff(held.task.decode_id), msg)

    async def _close_handoff(self, held: _Held, reason: str) -> None:
        """Close an open hand-off early: decode drops what it got and writes nothing (this instance told the
        client)."""
        if held.is_handing_off:
            held.is_handing_off = False
            await self._publish_handoff(held, Cancel(held.task.request_id, reason))

    async def _store_blocks(self, held: _Held, blocks: list[Payload]) -> None:
        """Off the critical path: put the prompt's new full blocks into the cache-store, in parts of whole layers (so
        that a later fetch can use each part as it arrives)."""
        assert self.cache is not None
        first, store = held.num_store_blocks, self.engine.store
        for i, data in enumerate(blocks):
            layer_bytes = store.payload_layer_bytes(first + i == 0)
            await self.cache.put_block(held.hashes[first + i], data, align_bytes=layer_bytes)

    def _flush_events(self) -> None:
        self.tasks.spawn(self._events_out.flush(), "kv-events")

    async def _fail_held(self, held: _Held, error_type: ErrorType, error: str) -> None:
        """Fail a request held here: its client hears, and decode drops whatever of its hand-off it got."""
        await self._fail(held.task.request_id, error_type, error)
        await self._close_handoff(held, f"failed at prefill: {error}")

    async def _fail(self, request_id: str, error_type: ErrorType, error: str) -> None:
        log.warning("prefill failed", request_id=request_id, error_type=error_type, error=error)
        event = StreamEvent.failure(request_id, error_type, error)
        await self.bus.publish(self.bus.subjects.stream(request_id), event)
