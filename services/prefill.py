"""The prefill service: computes prompts, streams each layer's KV to the chosen decode instance while the next layer
computes, sends the first token to the gateway, stores new full blocks in the cache-store and reuses stored ones.

It owns a prompt-only engine (every request leaves it after its first token); decoding belongs to services.decode.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from services.engine_host import EngineHost, block_from_bytes, block_to_bytes
from shared.blocks import block_hashes
from shared.bus import Bus, run_service
from shared.cache.client import CacheClient
from shared.config import Settings
from shared.engine.engine import EngineFull, LLMEngine, RequestOutput
from shared.engine.sequence import Sequence
from shared.heartbeat import HeartbeatSender, Load
from shared.kv_wire import chunk_layer_kv, num_kv_chunks
from shared.log import get_logger
from shared.protocol import (
    Cancel,
    DecodeTask,
    ErrorType,
    KvEvent,
    Message,
    PrefillTask,
    Role,
    StreamEvent,
)

log = get_logger(__name__)


@dataclass
class _Held:
    """A request from arrival until its hand-off to decode."""

    task: PrefillTask
    hashes: list[int]
    num_store_blocks: int = 0  # leading blocks the cache-store already holds
    num_chunks: int = 0
    sends: list[asyncio.Future[None]] = field(default_factory=list)
    cancelled: bool = False


class PrefillService:
    """Serves `prefill.<id>.run`.

    Args:
        settings: service settings.
        bus: the NATS connection.
        engine: a prompt-only engine (this service aborts each request after its first token).
        cache: the cache-store client, or None to run without the shared pool.
    """

    def __init__(self, settings: Settings, bus: Bus, engine: LLMEngine, cache: CacheClient | None) -> None:
        self.settings, self.bus, self.engine, self.cache = settings, bus, engine, cache
        self.host: EngineHost[tuple[RequestOutput, torch.Tensor | None]] = EngineHost(engine)
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="kv-encode")
        self._held: dict[str, _Held] = {}
        self._aborts: set[str] = set()
        self._heartbeat = HeartbeatSender(bus, settings.instance_id, Role.PREFILL, settings.heartbeat_s, self.load)
        self._event_seq = 0
        cfg = engine.model_config
        self._layer_token_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * engine.runner.pool.tensor.element_size()
        self._chunk_bytes = min(settings.kv_chunk_bytes, bus.max_payload // 2)
        self._block_shape = (cfg.num_layers, 2, cfg.num_kv_heads, 1, engine.config.block_size, cfg.head_dim)

    async def start(self) -> None:
        await self.bus.serve(self.bus.subjects.prefill_run(self.settings.instance_id), self.handle_task)
        await self.bus.serve(self.bus.subjects.cancel, self.handle_cancel)
        self.host.start(self._tick, self._deliver)
        self._heartbeat.start()
        await self._heartbeat.send_now()

    async def stop(self) -> None:
        await self._heartbeat.stop()
        await self.host.stop()
        self._encoder.shutdown(wait=True)

    def load(self) -> Load:
        tokens = sum(len(h.task.prompt_ids) - h.num_store_blocks * self.engine.config.block_size
                     for h in self._held.values())
        return Load(num_waiting=len(self._held), num_queued_tokens=tokens, request_ids=list(self._held))

    async def handle_task(self, msg: Message) -> None:
        assert isinstance(msg, PrefillTask)
        try:
            params = msg.sampling.to_params()
        except ValueError as exc:
            await self._fail(msg.request_id, ErrorType.INVALID, str(exc))
            return
        size = self.engine.config.block_size
        hashes = block_hashes(msg.prompt_ids, size, self.engine.block_manager.namespace)
        if msg.block_hashes and msg.block_hashes != hashes:
            log.warning("block hashes differ from the gateway's (model or codec mismatch?)", request_id=msg.request_id)
        held = _Held(msg, hashes, num_chunks=self._num_chunks(len(msg.prompt_ids)))
        self._held[msg.request_id] = held
        log.info("prefill queued", request_id=msg.request_id, prompt_tokens=len(msg.prompt_ids), decode=msg.decode_id)
        asyncio.create_task(self._admit(held, params))

    async def handle_cancel(self, msg: Message) -> None:
        assert isinstance(msg, Cancel)
        held = self._held.get(msg.request_id)
        if held is not None:
            held.cancelled = True
            self._aborts.add(msg.request_id)
            self.host.wake()
            log.info("prefill cancelled", request_id=msg.request_id, reason=msg.reason)

    def _num_chunks(self, num_tokens: int) -> int:
        cfg = self.engine.model_config
        return num_kv_chunks(cfg.num_layers, num_tokens, self._layer_token_bytes, self._chunk_bytes)

    async def _admit(self, held: _Held, params: Any) -> None:
        """Reuse what the cache-store holds beyond the local prefix cache, then queue the prompt in the engine."""
        task = held.task
        try:
            await self._fetch_prefix(held)
            if held.cancelled:
                self._held.pop(task.request_id, None)
                return
            await self.host.call(self.engine.add_request, task.request_id, task.prompt_ids, params)
        except Exception as exc:
            self._held.pop(task.request_id, None)
            await self._fail(task.request_id, ErrorType.INVALID if isinstance(exc, ValueError) else ErrorType.INTERNAL,
                             str(exc))
            return
        self.host.wake()

    async def _fetch_prefix(self, held: _Held) -> None:
        if self.cache is None or not held.hashes:
            return
        size = self.engine.config.block_size
        # The last block of a block-aligned prompt is always recomputed (its last token must be sampled from).
        usable = held.hashes[: (len(held.task.prompt_ids) - 1) // size]
        held.num_store_blocks = await self.cache.longest_prefix(held.hashes)
        local_tokens = await self.host.call(self.engine.block_manager.num_reusable_tokens, held.task.prompt_ids)
        first, last = local_tokens // size, min(held.num_store_blocks, len(usable))
        if last <= first:
            return
        blobs = await asyncio.gather(*(self.cache.get_block(h) for h in usable[first:last]))
        fetched = [block_from_bytes(b, self._block_shape, self.engine.runner.pool.tensor.dtype)
                   for b in blobs if b is not None]
        if len(fetched) < last - first:
            return  # a block went missing since `has`: compute instead
        try:
            num = await self.host.call(
                self.engine.import_prefix, held.task.prompt_ids, torch.cat(fetched, dim=3), first
            )
        except EngineFull:
            return
        log.info("prefix fetched from the cache-store", request_id=held.task.request_id, tokens=num,
                 blocks=last - first)

    # ---- the engine thread ------------------------------------------------------------------------------------

    def _tick(self) -> tuple[list[tuple[RequestOutput, torch.Tensor | None]], bool]:
        """One engine step on the engine thread; each finished prompt leaves the engine with its new blocks."""
        for request_id in list(self._aborts):
            self._aborts.discard(request_id)
            self.engine.abort(request_id)
        if not self.engine.has_unfinished():
            return [], False
        results = []
        for out in self.engine.step(self._on_layer):
            held = self._held.get(out.request_id)
            new_blocks = None
            if held is not None and self.cache is not None and not out.finished:
                num_full = len(held.task.prompt_ids) // self.engine.config.block_size
                if num_full > held.num_store_blocks:
                    new_blocks = self.engine.export_blocks(
                        out.request_id, held.num_store_blocks, num_full - held.num_store_blocks
                    )
            self.engine.abort(out.request_id)
            results.append((out, new_blocks))
        return results, self.engine.has_unfinished()

    def _on_layer(self, layer_idx: int, seqs: list[Sequence]) -> None:
        """Engine thread, mid-forward: copy this layer's prompt KV and hand it to the event loop to send."""
        for seq in seqs:
            held = self._held.get(seq.request_id)
            if held is None or held.cancelled:
                continue
            kv = self.engine.read_prompt_kv(seq.request_id, layer_idx)
            future = self.host.loop.create_future()
            held.sends.append(future)
            self.host.loop.call_soon_threadsafe(self._send_layer, held, layer_idx, kv, future)

    def _send_layer(self, held: _Held, layer_idx: int, kv: torch.Tensor, done: asyncio.Future[None]) -> None:
        async def send() -> None:
            per_layer = held.num_chunks // self.engine.model_config.num_layers
            encode = functools.partial(
                chunk_layer_kv, held.task.request_id, layer_idx, kv, layer_idx * per_layer, held.num_chunks,
                self._chunk_bytes, compress_payload=self.settings.kv_compress,
            )
            chunks = await self.host.loop.run_in_executor(self._encoder, encode)
            subject = self.bus.subjects.decode_kv(held.task.decode_id)
            for chunk in chunks:
                await self.bus.publish(subject, chunk)

        def settle(task: asyncio.Future[None]) -> None:
            error = task.exception()
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(None)

        asyncio.ensure_future(send()).add_done_callback(settle)

    # ---- back on the event loop -------------------------------------------------------------------------------

    async def _deliver(self, results: list[tuple[RequestOutput, torch.Tensor | None]]) -> None:
        for out, new_blocks in results:
            held = self._held.pop(out.request_id, None)
            if held is None or held.cancelled:
                continue
            try:
                await asyncio.gather(*held.sends)
            except Exception as exc:
                await self._fail(out.request_id, ErrorType.KV_TRANSFER, f"sending KV failed: {exc}")
                continue
            await self._hand_off(held, out)
            if new_blocks is not None:
                asyncio.create_task(self._store_blocks(held, new_blocks))

    async def _hand_off(self, held: _Held, out: RequestOutput) -> None:
        task, subjects = held.task, self.bus.subjects
        first = StreamEvent(
            task.request_id, 0, out.new_token_ids, out.new_text, out.finish_reason, out.num_prompt_tokens,
            out.num_cached_tokens,
        )
        await self.bus.publish(subjects.stream(task.request_id), first)
        if out.finished:  # done at the first token: decode drops the KV it got
            await self.bus.publish(subjects.decode_run(task.decode_id), Cancel(task.request_id, "finished at prefill"))
            log.info("finished at prefill", request_id=task.request_id, reason=out.finish_reason)
            return
        await self.bus.publish(subjects.decode_run(task.decode_id), DecodeTask(
            task.request_id, task.prompt_ids, out.new_token_ids[0], len(out.new_text), task.sampling,
            held.num_chunks, out.num_cached_tokens, self.settings.instance_id,
        ))
        log.info("prefilled", request_id=task.request_id, cached_tokens=out.num_cached_tokens,
                 ttft_s=round(time.time() - task.arrival_time, 4), kv_chunks=held.num_chunks)

    async def _store_blocks(self, held: _Held, blocks: torch.Tensor) -> None:
        """Off the critical path: put the prompt's new full blocks into the cache-store; announce local blocks."""
        assert self.cache is not None
        first = held.num_store_blocks
        for i in range(blocks.shape[3]):
            await self.cache.put_block(held.hashes[first + i], block_to_bytes(blocks[:, :, :, i : i + 1]))
        event = KvEvent(self.settings.instance_id, self._heartbeat.epoch, self._event_seq, "stored", held.hashes)
        self._event_seq += 1
        await self.bus.publish(self.bus.subjects.kv_events(self.settings.instance_id), event)

    async def _fail(self, request_id: str, error_type: ErrorType, error: str) -> None:
        log.warning("prefill failed", request_id=request_id, error_type=error_type, error=error)
        event = StreamEvent(request_id, -1, [], "", error_type=error_type, error=error)
        await self.bus.publish(self.bus.subjects.stream(request_id), event)


async def build(settings: Settings, bus: Bus) -> PrefillService:
    engine = await asyncio.to_thread(LLMEngine.from_path, settings.model_path, settings.engine)
    cache = CacheClient(bus, settings.cache_shards)
    return PrefillService(settings, bus, engine, cache)


def main() -> None:
    run_service(Role.PREFILL, build)


if __name__ == "__main__":
    main()
